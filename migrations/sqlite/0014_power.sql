-- Every power action through a node's BMC, carried out or failed, for the node's record
-- and for the reimage fallback (how often a BMC failed since the reimage was asked).
CREATE TABLE power_actions (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    mac         TEXT NOT NULL REFERENCES nodes(mac),
    at_ms       INTEGER NOT NULL,
    action      TEXT NOT NULL,                  -- on, off, soft-off, cycle
    reason      TEXT NOT NULL,
    outcome     TEXT NOT NULL,                  -- ok, or the BMC's error
    took_ms     INTEGER NOT NULL
);
CREATE INDEX power_actions_by_node ON power_actions (mac, id);
