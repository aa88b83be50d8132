-- Nodes, keyed by MAC. `version` is bumped by every write (optimistic locking).
CREATE TABLE nodes (
    mac            TEXT PRIMARY KEY,            -- aa:bb:cc:dd:ee:ff
    uuid           TEXT,                        -- machine UUID, when firmware sends one
    hostname       TEXT,
    labels         TEXT NOT NULL DEFAULT '{}',  -- JSON object of strings
    assigned_ref   TEXT,                        -- digest, name:version or name:tag
    state          TEXT NOT NULL,
    state_reason   TEXT NOT NULL,
    version        INTEGER NOT NULL,
    created_at_ms  INTEGER NOT NULL,
    updated_at_ms  INTEGER NOT NULL
);

-- Every state change, with its reason.
CREATE TABLE node_history (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    mac         TEXT NOT NULL REFERENCES nodes(mac),
    from_state  TEXT,                           -- NULL when the node was first recorded
    to_state    TEXT NOT NULL,
    reason      TEXT NOT NULL,
    at_ms       INTEGER NOT NULL
);
CREATE INDEX node_history_by_node ON node_history (mac, id);

-- One row per rendered boot script: the image it boots and the hash of its token.
CREATE TABLE boots (
    id            TEXT PRIMARY KEY,
    mac           TEXT NOT NULL REFERENCES nodes(mac),
    image_digest  TEXT NOT NULL REFERENCES images(digest),
    token_sha256  TEXT NOT NULL,                -- the token itself is never stored
    created_at_ms INTEGER NOT NULL
);
CREATE INDEX boots_by_node ON boots (mac, created_at_ms);
