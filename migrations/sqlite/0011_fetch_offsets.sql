-- Where each response started in its blob: "downloaded whole" counts distinct bytes, so
-- the same half fetched twice is not the whole.
ALTER TABLE boot_fetches ADD COLUMN offset_bytes INTEGER NOT NULL DEFAULT 0;
