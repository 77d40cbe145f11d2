-- Named queries of the consumer inbox (outbox.inbox). Same rules as relay.sql:
-- {schema} is an identifier, values are parameters. They run on the consumer's own session (its
-- search_path is the consumer's): pg_catalog's functions by their full names, operators on
-- their exact types (queries.APPLICATION_SESSION).

-- name: inbox_record
-- Record a delivery in the consumer's transaction: a row back on the first, none on a
-- duplicate. A concurrent insert of the same pair waits for the other transaction:
-- if it commits, this is a duplicate; if it rolls back, this is the first.
INSERT INTO {schema}.inbox (consumer, event_id) VALUES (%s, %s)
ON CONFLICT DO NOTHING
RETURNING true

-- name: inbox_record_numbered
-- inbox_record with numbered parameters (asyncpg).
INSERT INTO {schema}.inbox (consumer, event_id) VALUES ($1, $2)
ON CONFLICT DO NOTHING
RETURNING true

-- name: inbox_table
-- The inbox table of a schema, or NULL when `outbox migrate --inbox-only` has not run.
SELECT pg_catalog.to_regclass(pg_catalog.format('%%I.inbox', %s::text)) IS NOT NULL

-- name: inbox_table_numbered
-- inbox_table with a numbered parameter (asyncpg).
SELECT pg_catalog.to_regclass(pg_catalog.format('%I.inbox', $1::text)) IS NOT NULL

-- name: inbox_prune
-- Delete up to %(chunk)s inbox rows received before %(before)s (one chunk per transaction).
DELETE FROM {schema}.inbox AS i
USING (SELECT consumer, event_id FROM {schema}.inbox
       WHERE received_at < %(before)s::timestamptz
       LIMIT %(chunk)s::bigint
       FOR UPDATE SKIP LOCKED) AS old
WHERE i.consumer = old.consumer AND i.event_id = old.event_id

-- name: inbox_count_before
-- How many inbox rows were received before %(before)s (prune's progress total).
SELECT pg_catalog.count(*) FROM {schema}.inbox WHERE received_at < %(before)s::timestamptz
