-- TPM-rooted attestation (src/tpm/). A node's TPM endorsement key, enrolled at its first
-- TPM challenge (a later boot presenting another EK is refused until the enrolment is
-- removed with the node).
CREATE TABLE tpm_enrolments (
    mac             TEXT PRIMARY KEY,
    ek_name         TEXT NOT NULL,          -- the EK's TPM Name, hex
    certified       INTEGER NOT NULL,        -- 1: its certificate chained to an [tpm] ek_ca_files CA
    enrolled_at_ms  INTEGER NOT NULL
);
-- Each boot's challenge: the credential was made for this AK and carries a secret whose
-- hash is kept (never the secret). Ends when the boot attests.
CREATE TABLE tpm_challenges (
    boot_id         TEXT PRIMARY KEY,
    mac             TEXT NOT NULL,
    ak_public       TEXT NOT NULL,          -- the AK's TPM2B_PUBLIC, hex
    ek_name         TEXT NOT NULL,
    secret_sha256   TEXT NOT NULL,
    issued_at_ms    INTEGER NOT NULL
);
