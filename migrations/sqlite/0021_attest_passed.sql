-- Whether a boot's attestation passed, beside its verdict: the agent API's token check
-- reads it on every call, and parsing the verdict (TPM details and all) for one flag
-- each time costs more than the flag.
ALTER TABLE boots ADD COLUMN attest_passed INTEGER;
UPDATE boots SET attest_passed = json_extract(verdict, '$.passed') WHERE verdict IS NOT NULL;
