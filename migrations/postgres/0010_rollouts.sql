-- Rollouts (rollout/): one row each, its nodes with their wave and status, and the claims
-- that keep two rollouts from moving one node (a MAC is claimed by one rollout at most,
-- from its start until it finishes, is aborted or rolled back).
CREATE TABLE rollouts (
    id              BIGSERIAL PRIMARY KEY,
    spec            TEXT NOT NULL,          -- api::rollout::RolloutRequest as JSON
    digest          TEXT NOT NULL,          -- the image the spec's REF resolved to at start
    state           TEXT NOT NULL,
    state_reason    TEXT NOT NULL,
    wave            BIGINT NOT NULL,       -- the wave in progress
    version         BIGINT NOT NULL,
    created_at_ms   BIGINT NOT NULL,
    updated_at_ms   BIGINT NOT NULL
);
CREATE TABLE rollout_nodes (
    rollout_id          BIGINT NOT NULL REFERENCES rollouts (id) ON DELETE CASCADE,
    mac                 TEXT NOT NULL,
    wave                BIGINT NOT NULL,
    position            BIGINT NOT NULL,   -- the order within the rollout
    status              TEXT NOT NULL,
    previous_assigned   TEXT,
    previous_digest     TEXT,
    reason              TEXT NOT NULL,
    started_at_ms       BIGINT,            -- the current step's start (drain, reimage, rollback)
    finished_at_ms      BIGINT,
    reimaged_at_ms      BIGINT,            -- when the rollout reimaged it (what a rollback returns)
    PRIMARY KEY (rollout_id, mac)
);
CREATE TABLE rollout_claims (
    mac             TEXT PRIMARY KEY,
    rollout_id      BIGINT NOT NULL REFERENCES rollouts (id) ON DELETE CASCADE
);
CREATE INDEX rollout_claims_by_rollout ON rollout_claims (rollout_id);
