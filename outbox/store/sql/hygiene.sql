-- Named queries of hot-table hygiene (outbox.hygiene).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: can_vacuum_owner
-- Whether this session may VACUUM the hot table: it owns it (directly or by membership).
SELECT pg_has_role(current_user, c.relowner, 'USAGE')
FROM pg_class AS c WHERE c.oid = format('%%I.events', %(schema)s::text)::regclass

-- name: can_vacuum_maintain
-- PostgreSQL 17+: ... or holds MAINTAIN on it (granted to the relay role by `migrate --roles`).
SELECT pg_has_role(current_user, c.relowner, 'USAGE') OR has_table_privilege(c.oid, 'MAINTAIN')
FROM pg_class AS c WHERE c.oid = format('%%I.events', %(schema)s::text)::regclass

-- name: vacuum_events
-- Reclaim dead tuples of the hot table, refresh its statistics, truncate it when drained.
VACUUM (ANALYZE) {schema}.events

-- name: hygiene_try_lock
-- One relay at a time vacuums a schema's hot table: try its advisory lock.
SELECT pg_try_advisory_lock(%(lock)s)

-- name: hygiene_unlock
-- Release the hygiene advisory lock.
SELECT pg_advisory_unlock(%(lock)s)

-- name: events_heap_bytes
-- The heap's size of one schema's events table (after a vacuum: did it shrink?).
SELECT pg_relation_size(format('%%I.events', %(schema)s::text)::regclass)

-- name: hot_tables_stats
-- Dead and live tuples (statistics) and the heap's size (what VACUUM can truncate; its indexes
-- it cannot shrink) of the hot events table of each of several schemas, in one statement (a
-- relay serving many outboxes checks them all at once).
-- The statistics functions on each table's oid, looked up by name (the catalog's cache), not the
-- pg_stat_user_tables view, which groups every table of the database before it filters (20 ms a
-- look at 1,000 schemas; a join of pg_class to the schemas' names was a nested loop, worse).
-- Every table's size, dead tuples or not (the dead count can read 0 in a table of nothing else:
-- needs_vacuum): a system call each, 4 ms a look at 1,000 schemas.
SELECT t.schema, t.dead, pg_stat_get_live_tuples(t.oid), pg_relation_size(t.oid)
FROM (
    SELECT s.schema, c.oid, pg_stat_get_dead_tuples(c.oid) AS dead
    FROM unnest(%(schemas)s::text[]) AS s(schema)
    CROSS JOIN LATERAL to_regclass(format('%%I.events', s.schema)) AS c(oid)
    WHERE c.oid IS NOT NULL
) AS t
