-- Named queries of the write side (outbox.writer).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.
-- They run on the application's own session, whose search_path is the application's (another
-- role may have planted overloads there): every function is named in pg_catalog, and every
-- operator's arguments have the exact types of pg_catalog's (queries.APPLICATION_SESSION).

-- name: insert_event
-- One event, written by the application inside its own transaction (expires_at: epoch seconds
-- or NULL).
INSERT INTO {schema}.events (event_id, topic, key, payload, headers, type, subject, available_at, expires_at)
VALUES (%s, %s, %s, %s, %s, %s, %s, pg_catalog.now() + %s::float8 * interval '1 second',
        pg_catalog.to_timestamp(%s::float8))

-- name: insert_events_arrays
-- Many events as one statement (psycopg 3 and psycopg2, with delays or expiries): a column per
-- array parameter, rows in list order. One statement, never prepared, unlike executemany.
INSERT INTO {schema}.events (event_id, topic, key, payload, headers, type, subject, available_at, expires_at)
SELECT e, t, k, p, h, ty, su, pg_catalog.now() + d * interval '1 second', pg_catalog.to_timestamp(ex)
FROM ROWS FROM (pg_catalog.unnest(%s::uuid[]), pg_catalog.unnest(%s::text[]), pg_catalog.unnest(%s::bytea[]),
                pg_catalog.unnest(%s::bytea[]), pg_catalog.unnest(%s::jsonb[]), pg_catalog.unnest(%s::text[]),
                pg_catalog.unnest(%s::text[]), pg_catalog.unnest(%s::float8[]), pg_catalog.unnest(%s::float8[]))
    WITH ORDINALITY AS x (e, t, k, p, h, ty, su, d, ex, n)
ORDER BY n

-- name: copy_events_text
-- Many events without delay or expiry, streamed with COPY in text format (psycopg2's copy_expert;
-- asyncpg's copy_to_table writes the same statement itself).
COPY {schema}.events (event_id, topic, key, payload, headers, type, subject) FROM STDIN

-- name: insert_event_numbered
-- insert_event with numbered parameters (asyncpg).
INSERT INTO {schema}.events (event_id, topic, key, payload, headers, type, subject, available_at, expires_at)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, pg_catalog.now() + $8::float8 * interval '1 second',
        pg_catalog.to_timestamp($9::float8))

-- name: insert_events_arrays_numbered
-- insert_events_arrays with numbered parameters (asyncpg), every array text[] (bytes as hex):
-- asyncpg knows text[] but looks any other array type up with statements of its own.
INSERT INTO {schema}.events (event_id, topic, key, payload, headers, type, subject, available_at, expires_at)
SELECT e::uuid, t, pg_catalog.decode(k, 'hex'), pg_catalog.decode(p, 'hex'), h::jsonb, ty, su,
       pg_catalog.now() + d::float8 * interval '1 second', pg_catalog.to_timestamp(ex::float8)
FROM ROWS FROM (pg_catalog.unnest($1::text[]), pg_catalog.unnest($2::text[]), pg_catalog.unnest($3::text[]),
                pg_catalog.unnest($4::text[]), pg_catalog.unnest($5::text[]), pg_catalog.unnest($6::text[]),
                pg_catalog.unnest($7::text[]), pg_catalog.unnest($8::text[]), pg_catalog.unnest($9::text[]))
    WITH ORDINALITY AS x (e, t, k, p, h, ty, su, d, ex, n)
ORDER BY n

-- name: events_table_numbered
-- events_table with a numbered parameter (asyncpg).
SELECT pg_catalog.to_regclass(pg_catalog.format('%I.events', $1::text)) IS NOT NULL

-- name: first_statement
-- A statement that does nothing, to make SQLAlchemy's asyncpg adapter open its transaction.
SELECT 1

-- name: copy_events
-- Many events without delay or expiry, streamed with COPY (binary).
COPY {schema}.events (event_id, topic, key, payload, headers, type, subject) FROM STDIN (FORMAT BINARY)

-- name: events_table
-- The events table of a schema, or NULL when the schema has not been migrated.
SELECT pg_catalog.to_regclass(pg_catalog.format('%%I.events', %s::text)) IS NOT NULL

-- name: notify_trigger
-- Switch the NOTIFY-on-insert trigger on or off (`outbox notify on|off`).
ALTER TABLE {schema}.events {state} TRIGGER events_notify

-- name: listen_events
-- Wake-ups: LISTEN on the schema's channel (bound as an identifier by the caller).
LISTEN {channel}

-- name: unlisten_events
-- An outbox no longer served: UNLISTEN its schema's channel (an identifier, bound by the caller).
UNLISTEN {channel}
