-- Named API tokens, each with a role. Only the SHA-256 of a token is kept; a revoked
-- token keeps its row (and its name stays taken), so the audit trail never names two.
CREATE TABLE api_tokens (
    name           TEXT PRIMARY KEY,
    role           TEXT NOT NULL,
    secret_sha256  TEXT NOT NULL UNIQUE,
    created_at_ms  BIGINT NOT NULL,
    created_by     TEXT NOT NULL,
    revoked_at_ms  BIGINT,
    revoked_by     TEXT
);

-- Who did it: the token that made the request, NULL for the server's own work.
ALTER TABLE events ADD COLUMN actor TEXT;
ALTER TABLE node_history ADD COLUMN actor TEXT;
