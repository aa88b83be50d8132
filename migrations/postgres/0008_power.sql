-- Every power action through a node's BMC, carried out or failed, for the node's record
-- and for the reimage fallback (how often a BMC failed since the reimage was asked).
CREATE TABLE power_actions (
    id          BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    mac         TEXT NOT NULL REFERENCES nodes(mac),
    at_ms       BIGINT NOT NULL,
    action      TEXT NOT NULL,
    reason      TEXT NOT NULL,
    outcome     TEXT NOT NULL,
    took_ms     BIGINT NOT NULL
);
CREATE INDEX power_actions_by_node ON power_actions (mac, id);
