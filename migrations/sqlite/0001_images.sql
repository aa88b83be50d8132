-- Images are immutable: one row per digest, never updated.
CREATE TABLE images (
    digest        TEXT PRIMARY KEY,           -- sha256:<hex> of canonical
    name          TEXT NOT NULL,
    version       TEXT NOT NULL,
    manifest_toml TEXT NOT NULL,              -- as the admin wrote it
    canonical     TEXT NOT NULL,              -- the bytes the digest is computed over
    created_at_ms INTEGER NOT NULL,
    UNIQUE (name, version)
);

CREATE TABLE image_artifacts (
    image_digest TEXT NOT NULL REFERENCES images(digest),
    position     INTEGER NOT NULL,            -- canonical order
    role         TEXT NOT NULL CHECK (role IN ('kernel', 'initrd', 'rootfs')),
    path         TEXT NOT NULL,
    blob_digest  TEXT NOT NULL,
    size         INTEGER NOT NULL,
    PRIMARY KEY (image_digest, position)
);
CREATE INDEX image_artifacts_blob ON image_artifacts (blob_digest);

-- Tags are movable pointers; every move is kept in tag_history.
CREATE TABLE tags (
    name          TEXT NOT NULL,
    tag           TEXT NOT NULL,
    image_digest  TEXT NOT NULL REFERENCES images(digest),
    updated_at_ms INTEGER NOT NULL,
    PRIMARY KEY (name, tag)
);

CREATE TABLE tag_history (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    name         TEXT NOT NULL,
    tag          TEXT NOT NULL,
    from_digest  TEXT,                        -- NULL when the tag was created
    to_digest    TEXT NOT NULL,
    actor        TEXT NOT NULL,
    at_ms        INTEGER NOT NULL
);
CREATE INDEX tag_history_by_tag ON tag_history (name, tag, id);
