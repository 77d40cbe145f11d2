-- outbox 0011: what the operator console looks up at size, indexed (issue 27).
--
-- The archive is written at relay speed and was left without an index. A key's timeline,
-- `outbox replay --key` and an event's page looked up 10 million archived rows by scanning
-- them (seconds); the overview's chart and the last hour's count scanned today's partition.
-- Measured on the relay's archive insert (docs/console.md, "Speed"): the two B-trees cost
-- what they cost on every archived row; BRIN is summarised by vacuum, not on insert.
-- On an existing archive the build holds the archive's lock while it runs (about a minute
-- per 10 million rows here): the relay's archive inserts wait for it. Migrate in a quiet moment.
CREATE INDEX delivered_key_idx ON {schema}.delivered (key, delivered_at);
CREATE INDEX delivered_event_id_idx ON {schema}.delivered (event_id);
CREATE INDEX delivered_at_brin_idx ON {schema}.delivered USING brin (delivered_at);

-- A dead letter's error fingerprint: the error with ids (UUIDs) and numbers masked, so that
-- "too large (1048577 bytes)" and "too large (1048990 bytes)" are one group. Computed once
-- when the dead letter is written (a rewrite of dead_letters, small by nature), not on
-- every page view over 100,000 rows.
ALTER TABLE {schema}.dead_letters ADD COLUMN fingerprint text GENERATED ALWAYS AS (
    regexp_replace(regexp_replace(error,
        '[0-9a-fA-F]{{8}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{12}}',
        '<id>', 'g'), '[0-9]+', '<n>', 'g')
) STORED;
CREATE INDEX dead_letters_event_id_idx ON {schema}.dead_letters (event_id);
