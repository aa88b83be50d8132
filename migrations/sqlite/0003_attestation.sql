-- A boot is attested once: its verdict (JSON, every mismatch named) and when.
ALTER TABLE boots ADD COLUMN attested_at_ms INTEGER;
ALTER TABLE boots ADD COLUMN verdict TEXT;
