-- Named queries of the benchmark's baselines and probes (outbox/bench). Same
-- rules as queries.sql: {schema} is an identifier, values are parameters.

-- name: bare_claim
-- The bare loop: lock a batch in id order, no lease column, no ordering check.
SELECT id, event_id, topic, key, payload, headers
FROM {schema}.events
ORDER BY id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: seeds_claim
-- The seeds' loop: one row at a time.
SELECT id, event_id, topic, key, payload, headers
FROM {schema}.events
ORDER BY id
LIMIT 1
FOR UPDATE SKIP LOCKED

-- name: seeds_lease
-- The seeds' loop marks its claim on the row (their lease update).
UPDATE {schema}.events SET attempts = attempts + 1, available_at = now() + interval '30 seconds'
WHERE id = %s

-- name: seeds_delete
-- The seeds' loop deletes the published row.
DELETE FROM {schema}.events WHERE id = %s

-- name: bench_orders_table
-- The business table the benchmark's writers insert into.
CREATE TABLE IF NOT EXISTS {schema}.bench_orders (
    id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    customer text NOT NULL,
    amount integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)

-- name: bench_insert_order
-- One business row.
INSERT INTO {schema}.bench_orders (customer, amount) VALUES (%s, %s)

-- name: table_health
-- Size, live and dead tuples of the hot events table.
SELECT pg_total_relation_size(format('%%I.events', %(schema)s::text)::regclass),
       coalesce(s.n_live_tup, 0), coalesce(s.n_dead_tup, 0)
FROM (SELECT 1) AS one
LEFT JOIN pg_stat_user_tables AS s ON s.schemaname = %(schema)s AND s.relname = 'events'

-- name: notify_trigger
-- Switch the NOTIFY trigger (writer scenario measures both).
ALTER TABLE {schema}.events {state} TRIGGER events_notify
