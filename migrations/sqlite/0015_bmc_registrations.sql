-- Machines known only by their BMC, until one boots and is matched to its node by a NIC
-- MAC (macs: a JSON list of "52:54:00:..." strings) or its SMBIOS UUID (lower case).
CREATE TABLE bmc_registrations (
    id              INTEGER PRIMARY KEY AUTOINCREMENT,
    bmc             TEXT NOT NULL,          -- api::power::Bmc as JSON (a credential's name only)
    uuid            TEXT,
    macs            TEXT NOT NULL,
    registered_ms   INTEGER NOT NULL
);
CREATE INDEX bmc_registrations_by_uuid ON bmc_registrations (uuid);
