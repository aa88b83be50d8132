-- A [health] rule's revalidation of a node with a workload scheduler waits for its drain
-- (rollout/revalidate.rs): asked, then validating once drained, then handed back. One
-- per node; the row ends with the revalidation.
CREATE TABLE revalidation_drains (
    mac                 TEXT PRIMARY KEY,
    reason              TEXT NOT NULL,
    asked_at_ms         BIGINT NOT NULL,
    validating_at_ms    BIGINT             -- when it was drained and sent to validate
);
