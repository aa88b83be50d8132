-- A node's newest boot is the one inserted last (rowid), not the one with the latest
-- creation time: a clock that steps back between two boots must not bring an older
-- boot's token back. An index on mac alone ends in rowid, so it finds that boot.
CREATE INDEX boots_newest ON boots (mac);
