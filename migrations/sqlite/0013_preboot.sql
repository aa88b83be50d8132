-- What DHCP and TFTP saw of the node before it asked for this boot's script (JSON list
-- of {step, at_ms, outcome}), so a boot's timeline starts at its DHCP answer.
ALTER TABLE boots ADD COLUMN preboot TEXT;
