-- Roles one server plays at a time (webhook sender, sweeper): who holds each, until when.
CREATE TABLE leaders (
    role        TEXT PRIMARY KEY,
    holder      TEXT NOT NULL,
    expires_ms  INTEGER NOT NULL
);
