-- Named queries of the load harness shared by `outbox demo`, `outbox bench` and
-- `outbox bench faults` (outbox.harness). Same rules as the product's queries.

-- name: harness_orders_table
-- The business table the sample app writes an order into, next to its event.
CREATE TABLE IF NOT EXISTS {schema}.orders (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key        text NOT NULL,
    seq        integer NOT NULL,
    amount     integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)

-- name: harness_insert_order
-- One business row: the order of a key, with the key's sequence number.
INSERT INTO {schema}.orders (key, seq, amount) VALUES (%s, %s, %s)

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

-- name: harness_create_database
-- `outbox dev`: the quickstart's database, on the embedded server.
CREATE DATABASE {database}

-- name: harness_set_password
-- The embedded PostgreSQL's superuser gets a password of its own (generated for each server);
-- connections then need it: scram-sha-256 (harness.embedded writes pg_hba.conf).
ALTER ROLE CURRENT_USER PASSWORD {password}

-- name: harness_hba_file
-- Where the embedded server reads its client authentication rules.
SELECT current_setting('hba_file')
