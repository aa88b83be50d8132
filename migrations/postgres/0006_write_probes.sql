-- /readyz proves the store takes writes: each server upserts its row on every probe.
CREATE TABLE write_probes (
    server  TEXT PRIMARY KEY,
    at_ms   BIGINT NOT NULL
);
