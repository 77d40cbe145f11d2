-- outbox 0006: an event's type and subject (enqueue(..., type=, subject=)).
--
-- They become the CloudEvents `type` and `subject` attributes when the relay runs with
-- --cloudevents (type defaults to the topic when NULL). Kept through the archive and the
-- dead letters so that a replay or a redrive sends the same. Nullable, no default: adding
-- them changes only the catalog, not a row.
ALTER TABLE {schema}.events ADD COLUMN type text, ADD COLUMN subject text;
ALTER TABLE {schema}.delivered ADD COLUMN type text, ADD COLUMN subject text;
ALTER TABLE {schema}.dead_letters ADD COLUMN type text, ADD COLUMN subject text;
