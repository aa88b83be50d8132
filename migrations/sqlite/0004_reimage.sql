-- Reimage requests by Idempotency-Key: a repeated request gets the first answer.
CREATE TABLE reimage_requests (
    key        TEXT PRIMARY KEY,
    mac        TEXT NOT NULL,
    response   TEXT NOT NULL,                  -- JSON of the first answer
    at_ms      INTEGER NOT NULL
);
ALTER TABLE nodes ADD COLUMN last_heartbeat_ms INTEGER;
