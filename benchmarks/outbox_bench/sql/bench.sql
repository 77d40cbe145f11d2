-- Named queries of the benchmark's baselines and probes (benchmarks/outbox_bench). Same
-- rules as queries.sql: {schema} is an identifier, values are parameters.

-- name: bare_claim
-- The bare loop: lock a batch in id order, no lease column, no ordering check. The id and the
-- headers come as text, as the relay's claim sends them (the cheapest to turn into Kafka's).
SELECT id, event_id::text, topic, key, payload, nullif(headers, '{{}}'::jsonb)::text
FROM {schema}.events
ORDER BY id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: sink_loop_claim
-- The sink benchmark's minimal loops: as bare_claim, the headers as a JSON object (their
-- clients take a mapping).
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

-- name: ceiling_tables
-- The ceiling's own plain tables: no generated column, no partitions, no triggers.
CREATE TABLE {schema}.plain_events (
    id       bigserial PRIMARY KEY,
    event_id uuid      NOT NULL,
    topic    text      NOT NULL,
    key      bytea,
    payload  bytea     NOT NULL,
    headers  jsonb     NOT NULL DEFAULT '{{}}'
);
CREATE TABLE {schema}.plain_archive (
    id           bigint      NOT NULL,
    event_id     uuid        NOT NULL,
    topic        text        NOT NULL,
    key          bytea,
    payload      bytea       NOT NULL,
    headers      jsonb       NOT NULL,
    delivered_at timestamptz NOT NULL DEFAULT now()
)

-- name: ceiling_fill
-- The same events as the outbox's table (filled by enqueue_many), moved to the plain table.
WITH moved AS (DELETE FROM {schema}.events RETURNING id, event_id, topic, key, payload, headers)
INSERT INTO {schema}.plain_events (event_id, topic, key, payload, headers)
SELECT event_id, topic, key, payload, headers FROM moved ORDER BY id

-- name: ceiling_claim
-- As bare_claim, on the ceiling's plain table.
SELECT id, event_id::text, topic, key, payload, nullif(headers, '{{}}'::jsonb)::text
FROM {schema}.plain_events
ORDER BY id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: ceiling_archive
WITH done AS (
    DELETE FROM {schema}.plain_events WHERE id = ANY(%(ids)s)
    RETURNING id, event_id, topic, key, payload, headers
)
INSERT INTO {schema}.plain_archive (id, event_id, topic, key, payload, headers)
SELECT id, event_id, topic, key, payload, headers FROM done

-- name: ceiling_wal_archive
-- The WAL ceiling's archive: the events read from the slot and produced, into the plain archive
-- (the arrays in binary, as the relay sends its own).
INSERT INTO {schema}.plain_archive (id, event_id, topic, key, payload, headers)
SELECT i, e, t, k, p, h
FROM unnest(%(ids)s::bigint[], %(event_ids)b::uuid[], %(topics)b::text[], %(keys)b::bytea[],
            %(payloads)b::bytea[], %(headers)b::jsonb[]) AS x (i, e, t, k, p, h)

-- name: ceiling_analyze
ANALYZE {schema}.plain_events

-- name: console_fill_archive_day
-- One day partition of the archive for a past day, as a relay running that long made it.
CREATE TABLE IF NOT EXISTS {schema}.{partition} PARTITION OF {schema}.delivered
    FOR VALUES FROM ({since}) TO ({until})

-- name: console_fill_functions
-- The fill's events, written once for the archive and the pending events: order ``i`` as
-- JSON (what bench.events.order writes) and the headers an instrumented writer attaches.
CREATE FUNCTION {schema}.bench_order(i bigint, keys integer) RETURNS bytea
LANGUAGE sql IMMUTABLE AS $$
    SELECT convert_to(json_build_object(
        'order_id', i, 'customer', 'customer-' || (i % keys), 'status', 'created',
        'placed_at', '2026-11-23T01:00:00.000Z',
        'items', json_build_array(json_build_object('sku', 'sku-' || (i % 97), 'qty', 1 + i % 3,
                                                    'price', '19.99')),
        'total', '19.99', 'currency', 'EUR', 'channel', 'web')::text, 'UTF8')
$$;
CREATE FUNCTION {schema}.bench_headers(i bigint) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT jsonb_build_object('content-type', 'application/json',
                              'traceparent', '00-' || md5(i::text) || '-' || left(md5((-i)::text), 16) || '-01')
$$

-- name: console_fill_archive
-- Archived events %(first)s..%(last)s: orders as JSON with their trace headers, keyed by
-- %(keys)s customers over %(topics)s topics, delivered evenly over the %(days)s days before
-- now, with Kafka coordinates.
INSERT INTO {schema}.delivered (id, event_id, topic, key, payload, headers, created_at,
                                delivered_at, attempts, sink_partition, sink_offset, type)
SELECT i, gen_random_uuid(), 'bench.topic-' || (i %% %(topics)s),
       convert_to('customer-' || (i %% %(keys)s), 'UTF8'),
       {schema}.bench_order(i, %(keys)s), {schema}.bench_headers(i),
       t - interval '20 milliseconds', t, 1, (i %% 4)::integer, i / 4, 'order.created'
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
     LATERAL (SELECT now() - %(days)s * interval '1 day'
                     * (1 - (i - 1)::float8 / %(total)s::float8) AS t) AS at

-- name: console_fill_dead
-- %(n)s dead letters (ids 1..n, below every pending event) over %(keys)s keys; each key's
-- first one parks it. Errors come from a handful of causes, with ids and numbers in them.
INSERT INTO {schema}.dead_letters (id, event_id, topic, key, payload, headers, created_at,
                                   attempts, error, first_failed_at, failed_at, parked, type)
SELECT i, gen_random_uuid(), 'bench.topic-' || (i %% %(topics)s),
       convert_to('customer-' || (i %% %(keys)s), 'UTF8'),
       convert_to('{{"order_id": ' || i || ', "status": "created"}}', 'UTF8'),
       '{{"content-type": "application/json"}}'::jsonb,
       now() - interval '2 days' + i * interval '1 second',
       CASE WHEN i %% 5 = 0 THEN 1 ELSE 8 END,
       CASE i %% 6
           WHEN 0 THEN 'refused: message too large (' || (1048576 + i) || ' bytes > 1048576)'
           WHEN 1 THEN 'refused: schema registry rejected event ' || gen_random_uuid()
           WHEN 2 THEN 'unreachable: connection to 10.0.' || (i %% 250) || '.7:9092 refused'
           WHEN 3 THEN 'timeout: no acknowledgement within 30 s (attempt ' || (i %% 9) || ')'
           WHEN 4 THEN 'refused: topic authorization failed for bench.topic-' || (i %% %(topics)s)
           ELSE 'http_5xx: webhook answered 503 after ' || (i %% 1000) || ' ms'
       END,
       now() - interval '2 days' + i * interval '1 second',
       now() - interval '2 days' + i * interval '1 second' + interval '5 minutes',
       i <= %(keys)s, 'order.created'
FROM generate_series(1, %(n)s::bigint) AS i

-- name: console_fill_pending
-- Pending events %(first)s..%(last)s as enqueue writes them (orders as JSON with their trace
-- headers), keyed by %(keys)s customers over %(topics)s topics; one in a hundred is retrying.
INSERT INTO {schema}.events (id, event_id, topic, key, payload, headers, created_at,
                             available_at, attempts, last_error, last_error_kind,
                             first_failed_at, type)
OVERRIDING SYSTEM VALUE
SELECT i, gen_random_uuid(), 'bench.topic-' || (i %% %(topics)s),
       convert_to('customer-' || (i %% %(keys)s), 'UTF8'),
       {schema}.bench_order(i, %(keys)s), {schema}.bench_headers(i),
       now() - interval '1 hour' + (i - %(first)s) * interval '1 millisecond',
       CASE WHEN i %% 100 = 0 THEN now() + interval '5 minutes' ELSE now() END,
       CASE WHEN i %% 100 = 0 THEN 3 ELSE 0 END,
       CASE WHEN i %% 100 = 0 THEN 'unreachable: broker 127.0.0.1:9092 not answering' END,
       CASE WHEN i %% 100 = 0 THEN 'unreachable' END,
       CASE WHEN i %% 100 = 0 THEN now() - interval '10 minutes' END,
       'order.created'
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i

-- name: console_fill_done
-- After a fill: the identity continues past the filled ids; statistics and visibility maps as
-- a database running for days has them.
SELECT setval(pg_get_serial_sequence({schema_name} || '.events', 'id'),
              (SELECT max(id) FROM {schema}.events))

-- name: bench_vacuum_outbox
-- Statistics and visibility maps, as autovacuum keeps them on a database running for days (the
-- console's fill); or autovacuum's work done before a measurement that counts transactions, so
-- that none of it falls inside (the tenants scenario's idle window).
VACUUM (ANALYZE) {schema}.events, {schema}.dead_letters, {schema}.delivered

-- name: console_bench_samples
-- What the console scenario asks for: a parked key (the 42nd) and, of that key, a pending
-- event, its parking dead letter and its latest archived event; the dead letters' high-water mark
-- (the last seq, migration 0016).
WITH k AS (SELECT key FROM {schema}.dead_letters WHERE parked ORDER BY id OFFSET 41 LIMIT 1)
SELECT (SELECT event_id::text FROM {schema}.events WHERE key = (SELECT key FROM k) ORDER BY id LIMIT 1),
       (SELECT event_id::text FROM {schema}.dead_letters WHERE key = (SELECT key FROM k) AND parked),
       (SELECT event_id::text FROM {schema}.delivered WHERE key = (SELECT key FROM k)
        ORDER BY delivered_at DESC LIMIT 1),
       (SELECT convert_from(key, 'UTF8') FROM k),
       (SELECT max(seq) FROM {schema}.dead_letters)

-- name: console_bench_sizes
-- The filled outbox: pending, dead letters, archived, and its tables' bytes with indexes.
SELECT (SELECT count(*) FROM {schema}.events), (SELECT count(*) FROM {schema}.dead_letters),
       (SELECT count(*) FROM {schema}.delivered),
       (SELECT sum(pg_total_relation_size(c.oid)) FROM pg_class AS c
        JOIN pg_namespace AS n ON n.oid = c.relnamespace
        WHERE n.nspname = {schema_name} AND c.relkind = 'r')

-- name: bench_database_transactions
-- Transactions committed and rolled back in this database so far: the tenants scenario's idle
-- cost of a relay (what it asks of the database while there is nothing to do).
SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()

-- name: bench_autovacuum_busy
-- Autovacuum workers at work in this database (the tenants scenario waits for them before it
-- counts an idle relay's transactions).
SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'autovacuum worker' AND datname = current_database()

-- name: bench_slot_wal
-- The snapshot scenario's look at a slot: the WAL it keeps (from its restart position) and the
-- WAL not yet confirmed, in bytes.
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint,
       pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint
FROM pg_replication_slots WHERE slot_name = %(slot)s

-- name: bench_archived_of_topic
-- Events of a topic archived so far (the limits scenario reads a route's drain from the archive).
SELECT count(*) FROM {schema}.delivered WHERE topic = %(topic)s

-- name: backend_pid
-- The server process of this session (the bench reads its CPU while it fills an outbox).
SELECT pg_catalog.pg_backend_pid()
