-- Blobs `image verify` found damaged or missing: an image needing one is broken and is
-- handed to no node until a re-publish restores the blob (and removes the row).
CREATE TABLE broken_blobs (
    digest  TEXT PRIMARY KEY,
    reason  TEXT NOT NULL,
    at_ms   BIGINT NOT NULL
);
