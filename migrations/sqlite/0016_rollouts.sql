-- Rollouts (rollout/): one row each, its nodes with their wave and status, and the claims
-- that keep two rollouts from moving one node (a MAC is claimed by one rollout at most,
-- from its start until it finishes, is aborted or rolled back).
CREATE TABLE rollouts (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    spec            TEXT NOT NULL,          -- api::rollout::RolloutRequest as JSON
    digest          TEXT NOT NULL,          -- the image the spec's REF resolved to at start
    state           TEXT NOT NULL,
    state_reason    TEXT NOT NULL,
    wave            INTEGER NOT NULL,       -- the wave in progress
    version         INTEGER NOT NULL,
    created_at_ms   INTEGER NOT NULL,
    updated_at_ms   INTEGER NOT NULL
);
CREATE TABLE rollout_nodes (
    rollout_id          INTEGER NOT NULL REFERENCES rollouts (id) ON DELETE CASCADE,
    mac                 TEXT NOT NULL,
    wave                INTEGER NOT NULL,
    position            INTEGER NOT NULL,   -- the order within the rollout
    status              TEXT NOT NULL,
    previous_assigned   TEXT,
    previous_digest     TEXT,
    reason              TEXT NOT NULL,
    started_at_ms       INTEGER,            -- the current step's start (drain, reimage, rollback)
    finished_at_ms      INTEGER,
    reimaged_at_ms      INTEGER,            -- when the rollout reimaged it (what a rollback returns)
    PRIMARY KEY (rollout_id, mac)
);
CREATE TABLE rollout_claims (
    mac             TEXT PRIMARY KEY,
    rollout_id      INTEGER NOT NULL REFERENCES rollouts (id) ON DELETE CASCADE
);
CREATE INDEX rollout_claims_by_rollout ON rollout_claims (rollout_id);
