-- A [health] rule's revalidation of a node with a workload scheduler waits for its drain
-- (rollout/revalidate.rs): queued, asked (at most [drain] revalidations_at_once nodes at
-- a time), validating once drained, then handed back. One per node; the row ends with
-- the revalidation.
CREATE TABLE revalidation_drains (
    mac                 TEXT PRIMARY KEY,
    reason              TEXT NOT NULL,
    queued_at_ms        INTEGER NOT NULL,
    asked_at_ms         INTEGER,               -- when its drain was asked (None: waiting its turn)
    validating_at_ms    INTEGER            -- when it was drained and sent to validate
);
