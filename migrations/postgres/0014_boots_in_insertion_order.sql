-- A node's newest boot is the one inserted last (seq; a node's boots are inserted one
-- at a time, each under the compare-and-set of its node's row), not the one with the
-- latest creation time: a clock that steps back, or another server's clock behind,
-- must not bring an older boot's token back.
CREATE INDEX boots_newest ON boots (mac, seq);
