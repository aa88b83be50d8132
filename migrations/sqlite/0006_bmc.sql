-- The node's BMC (JSON: address, protocol, credential reference), for power control; set
-- by the BMC work. NULL: none known.
ALTER TABLE nodes ADD COLUMN bmc TEXT;
