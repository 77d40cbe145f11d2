-- outbox 0011: what the operator console looks up at size, indexed (issue 27).
--
-- The archive is written at relay speed and was left without an index. A key's timeline,
-- `outbox replay --key` and an archived event's page scanned 10 million archived rows
-- (seconds); the overview's chart and the last hour's count scanned today's partition.
-- Two indexes, measured on the relay's drain (docs/console.md, "Speed"): keys repeat, so the
-- B-tree on (key, delivered_at) is written where it was written before; BRIN is summarised
-- by vacuum, not on insert. Not indexed: event_id. A random UUID lands on a random page of
-- its index on every archived row, and with that index the relay drained about a fifth
-- slower; the console finds an archived event through its key.
-- On an existing archive the build holds the archive's lock while it runs (under a minute
-- per 10 million rows here): the relay's archive inserts wait for it. Migrate in a quiet moment.
CREATE INDEX delivered_key_idx ON {schema}.delivered (key, delivered_at);
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
