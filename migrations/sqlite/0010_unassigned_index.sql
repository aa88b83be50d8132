-- The discovery cap counts unassigned discovered nodes for each new MAC.
CREATE INDEX nodes_unassigned ON nodes (state) WHERE assigned_ref IS NULL;
