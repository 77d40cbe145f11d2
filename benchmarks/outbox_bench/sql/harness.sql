-- Named statements of the bench's harness: the fault suite's counts and ids, its writers' orders, a
-- workspace's clean-up (outbox_bench.queries; the runtime's own are in outbox/store/sql/).

-- name: harness_insert_order_numbered
-- harness_insert_order with numbered parameters (asyncpg).
INSERT INTO {schema}.orders (key, seq, amount) VALUES ($1, $2, $3)

-- name: harness_insert_order_named
-- harness_insert_order with named parameters (SQLAlchemy text()).
INSERT INTO {schema}.orders (key, seq, amount) VALUES (:key, :seq, :amount)

-- name: harness_count_orders
-- Rows of the business table (read to hold a snapshot open).
SELECT count(*) FROM {schema}.orders

-- name: harness_table_size
-- Pending events, heap bytes and total bytes of the hot events table.
SELECT (SELECT count(*) FROM {schema}.events),
       pg_relation_size(format('%%I.events', %(schema)s::text)::regclass),
       pg_total_relation_size(format('%%I.events', %(schema)s::text)::regclass)

-- name: harness_pending_count
-- Events still pending.
SELECT count(*) FROM {schema}.events

-- name: harness_pending_ids
-- Event ids still pending.
SELECT event_id::text FROM {schema}.events

-- name: harness_archived_ids
-- Archived event ids, with how many times each was archived (must be once).
SELECT event_id::text, count(*) FROM {schema}.delivered GROUP BY 1

-- name: harness_dead_ids
-- Dead-lettered event ids with their attempts.
SELECT event_id::text, attempts FROM {schema}.dead_letters

-- name: harness_terminate_relays
-- End every relay session of this database (pg_terminate_backend), reporting the state each was in.
SELECT pg_terminate_backend(pid), state FROM pg_stat_activity
WHERE application_name LIKE 'outbox-%%' AND datname = current_database() AND pid <> pg_backend_pid()

-- name: harness_drop_schema
-- Remove a scenario's schema and everything in it.
DROP SCHEMA {schema} CASCADE

-- name: harness_analyze
-- ANALYZE the hot table (the bench's "ANALYZE after the fill" case).
ANALYZE {schema}.events

-- name: harness_server_version
-- The server's version, for the report's machine line.
SHOW server_version
