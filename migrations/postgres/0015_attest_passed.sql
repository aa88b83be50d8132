-- Whether a boot's attestation passed, beside its verdict: the agent API's token check
-- reads it on every call (PostgreSQL's servers keep no boot cache), and parsing the
-- verdict (TPM details and all) for one flag each time costs more than the flag.
ALTER TABLE boots ADD COLUMN attest_passed BOOLEAN;
UPDATE boots SET attest_passed = (verdict::json ->> 'passed') = 'true' WHERE verdict IS NOT NULL;
