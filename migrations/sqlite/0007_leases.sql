-- Authoritative DHCP leases (bound ones; offers live in memory only). Written in batches.
CREATE TABLE dhcp_leases (
    mac         TEXT PRIMARY KEY,
    ip          TEXT NOT NULL,
    expires_ms  INTEGER NOT NULL
);
