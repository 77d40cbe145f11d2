-- outbox 0022: the archive says which events a transform dropped (issue 60).
--
-- `outbox relay --transform GLOB=module:function` runs an operator's function on each event of
-- matching topics; one that returns None drops the event, which is archived like a delivered
-- one, with filtered_by naming the transform (GLOB=module:function) instead of a sink's
-- coordinates. NULL: delivered to a sink. A nullable column without a default: no rewrite of the
-- archive's partitions, and relays of earlier versions (which name their columns) go on
-- archiving beside this one.
ALTER TABLE {schema}.delivered ADD COLUMN filtered_by text;
