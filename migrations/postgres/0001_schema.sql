-- The PostgreSQL schema: the same tables and columns as migrations/sqlite (its history
-- folded into one first migration), with PostgreSQL's types. Times are epoch
-- milliseconds (BIGINT); JSON columns are TEXT, written and read by the store as
-- strings, as in SQLite, so one set of row decoders serves both backends.

-- Images are immutable: one row per digest, never updated.
CREATE TABLE images (
    digest        TEXT PRIMARY KEY,           -- sha256:<hex> of canonical
    name          TEXT NOT NULL,
    version       TEXT NOT NULL,
    manifest_toml TEXT NOT NULL,              -- as the admin wrote it
    canonical     TEXT NOT NULL,              -- the bytes the digest is computed over
    created_at_ms BIGINT NOT NULL,
    UNIQUE (name, version)
);

CREATE TABLE image_artifacts (
    image_digest TEXT NOT NULL REFERENCES images(digest),
    position     BIGINT NOT NULL,             -- canonical order
    role         TEXT NOT NULL CHECK (role IN ('kernel', 'initrd', 'rootfs')),
    path         TEXT NOT NULL,
    blob_digest  TEXT NOT NULL,
    size         BIGINT NOT NULL,
    PRIMARY KEY (image_digest, position)
);
CREATE INDEX image_artifacts_blob ON image_artifacts (blob_digest);

-- Tags are movable pointers; every move is kept in tag_history.
CREATE TABLE tags (
    name          TEXT NOT NULL,
    tag           TEXT NOT NULL,
    image_digest  TEXT NOT NULL REFERENCES images(digest),
    updated_at_ms BIGINT NOT NULL,
    PRIMARY KEY (name, tag)
);

CREATE TABLE tag_history (
    id           BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    name         TEXT NOT NULL,
    tag          TEXT NOT NULL,
    from_digest  TEXT,                        -- NULL when the tag was created
    to_digest    TEXT NOT NULL,
    actor        TEXT NOT NULL,
    at_ms        BIGINT NOT NULL
);
CREATE INDEX tag_history_by_tag ON tag_history (name, tag, id);

-- Nodes, keyed by MAC. `version` is bumped by every write (compare-and-set).
CREATE TABLE nodes (
    mac                  TEXT PRIMARY KEY,      -- aa:bb:cc:dd:ee:ff
    uuid                 TEXT,
    hostname             TEXT,
    labels               TEXT NOT NULL DEFAULT '{}',
    assigned_ref         TEXT,
    state                TEXT NOT NULL,
    state_reason         TEXT NOT NULL,
    version              BIGINT NOT NULL,
    created_at_ms        BIGINT NOT NULL,
    updated_at_ms        BIGINT NOT NULL,
    last_heartbeat_ms    BIGINT,
    revalidate_requested BOOLEAN NOT NULL DEFAULT FALSE,
    bmc                  TEXT
);
CREATE INDEX nodes_by_state ON nodes (state);

CREATE TABLE node_history (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    mac         TEXT NOT NULL REFERENCES nodes(mac),
    from_state  TEXT,
    to_state    TEXT NOT NULL,
    reason      TEXT NOT NULL,
    at_ms       BIGINT NOT NULL
);
CREATE INDEX node_history_by_node ON node_history (mac, id);

-- `seq` orders a node's boots that share a millisecond (SQLite's rowid).
CREATE TABLE boots (
    id              TEXT PRIMARY KEY,
    seq             BIGINT GENERATED ALWAYS AS IDENTITY,
    mac             TEXT NOT NULL REFERENCES nodes(mac),
    image_digest    TEXT NOT NULL REFERENCES images(digest),
    token_sha256    TEXT NOT NULL,
    created_at_ms   BIGINT NOT NULL,
    attested_at_ms  BIGINT,
    verdict         TEXT,
    report          TEXT,
    validated_at_ms BIGINT,
    validation      TEXT
);
CREATE INDEX boots_by_node ON boots (mac, created_at_ms, seq);

CREATE TABLE reimage_requests (
    key        TEXT PRIMARY KEY,
    mac        TEXT NOT NULL,
    response   TEXT NOT NULL,
    at_ms      BIGINT NOT NULL
);

-- One ordered log across every server. `seq` is not a sequence: sequences hand out
-- numbers at insert and transactions commit in another order, so a reader could pass a
-- number whose row commits later. The store takes a transaction-scoped advisory lock
-- before it writes an event and numbers it MAX(seq) + 1: numbers follow commit order,
-- with no gaps.
CREATE TABLE events (
    seq    BIGINT PRIMARY KEY,
    at_ms  BIGINT NOT NULL,
    kind   TEXT NOT NULL,
    mac    TEXT,
    data   TEXT NOT NULL
);
CREATE INDEX events_by_node ON events (mac, seq);

CREATE TABLE webhook_cursors (
    url   TEXT PRIMARY KEY,
    seq   BIGINT NOT NULL
);

CREATE TABLE boot_fetches (
    id              BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    boot_id         TEXT NOT NULL REFERENCES boots(id),
    digest          TEXT NOT NULL,
    started_at_ms   BIGINT NOT NULL,
    finished_at_ms  BIGINT,
    bytes           BIGINT NOT NULL,
    whole           BOOLEAN NOT NULL
);
CREATE INDEX boot_fetches_by_boot ON boot_fetches (boot_id, id);

CREATE TABLE dhcp_leases (
    mac         TEXT PRIMARY KEY,
    ip          TEXT NOT NULL,
    expires_ms  BIGINT NOT NULL
);
