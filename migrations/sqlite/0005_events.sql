-- Every node transition, refused report and refused reimage, in one ordered log.
-- `seq` is the cursor of the events API, the SSE stream and webhook delivery.
CREATE TABLE events (
    seq    INTEGER PRIMARY KEY AUTOINCREMENT,
    at_ms  INTEGER NOT NULL,
    kind   TEXT NOT NULL,                 -- node.state, report.refused, reimage.refused, node.drift
    mac    TEXT,                          -- the node concerned (claimed, for a refused report)
    data   TEXT NOT NULL                  -- JSON object
);
CREATE INDEX events_by_node ON events (mac, seq);

-- How far each webhook has been delivered (the last seq its receiver acknowledged).
CREATE TABLE webhook_cursors (
    url   TEXT PRIMARY KEY,
    seq   INTEGER NOT NULL
);

-- Artifacts fetched for a boot (blob URLs carry ?boot=<id>): what the boot received.
CREATE TABLE boot_fetches (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    boot_id         TEXT NOT NULL REFERENCES boots(id),
    digest          TEXT NOT NULL,
    started_at_ms   INTEGER NOT NULL,
    finished_at_ms  INTEGER,              -- NULL: the transfer did not finish
    bytes           INTEGER NOT NULL,     -- bytes sent
    whole           INTEGER NOT NULL      -- 1: the whole blob was sent in this response
);
CREATE INDEX boot_fetches_by_boot ON boot_fetches (boot_id, id);

-- What the node reported at attestation (JSON), the baseline drift is measured against.
ALTER TABLE boots ADD COLUMN report TEXT;
-- Validation: when and the verdict (JSON).
ALTER TABLE boots ADD COLUMN validated_at_ms INTEGER;
ALTER TABLE boots ADD COLUMN validation TEXT;
-- An admin asked for revalidation; the next heartbeat answers "revalidate" once.
ALTER TABLE nodes ADD COLUMN revalidate_requested INTEGER NOT NULL DEFAULT 0;
