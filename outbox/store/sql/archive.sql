-- Named queries of the archive: replay and purge (outbox.archive).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: replay_count
-- How many archived events a replay would re-send, and the highest id among them (a replay
-- bound by it never re-sends the copies it queued itself, whatever its window).
SELECT count(*), coalesce(max(id), 0) FROM {schema}.delivered
WHERE delivered_at >= %(since)s AND delivered_at < %(until)s
  AND (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(key)s::bytea IS NULL OR key = %(key)s)
  AND (%(upto)s::bigint IS NULL OR id <= %(upto)s)

-- name: replay_chunk
-- Re-send the next chunk of archived events (in delivery order) as new events:
-- a new event-id, and header outbox-replay-of = the original event-id.
-- Returns how many were queued and where the chunk ended.
WITH src AS (
    SELECT id, event_id, topic, key, payload, headers, delivered_at, type, subject
    FROM {schema}.delivered
    WHERE delivered_at >= %(since)s AND delivered_at < %(until)s
      AND (%(topic)s::text IS NULL OR topic = %(topic)s)
      AND (%(key)s::bytea IS NULL OR key = %(key)s)
      AND (%(upto)s::bigint IS NULL OR id <= %(upto)s)
      AND (delivered_at, id) > (%(after_at)s::timestamptz, %(after_id)s::bigint)
    ORDER BY delivered_at, id
    LIMIT %(limit)s
), queued AS (
    INSERT INTO {schema}.events (event_id, topic, key, payload, headers, type, subject)
    SELECT gen_random_uuid(), topic, key, payload,
           headers || jsonb_build_object('outbox-replay-of', event_id::text), type, subject
    FROM src
    ORDER BY delivered_at, id
)
SELECT count(*), max(delivered_at),
       (SELECT id FROM src ORDER BY delivered_at DESC, id DESC LIMIT 1)
FROM src

-- name: archive_partitions
-- The archive's day partitions (and the default one), by name.
SELECT c.relname
FROM pg_inherits AS i
JOIN pg_class AS c ON c.oid = i.inhrelid
JOIN pg_class AS p ON p.oid = i.inhparent
JOIN pg_namespace AS n ON n.oid = p.relnamespace
WHERE n.nspname = %(schema)s AND p.relname = 'delivered'
ORDER BY c.relname

-- name: purge_default_chunk
-- Delete a chunk of old rows from the default archive partition.
DELETE FROM {schema}.delivered_default
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {schema}.delivered_default WHERE delivered_at < %(cutoff)s LIMIT %(limit)s))

-- name: drop_archive_partition
-- Drop one day partition of the archive (retention by DROP, not DELETE).
DROP TABLE {schema}.{partition}

-- name: archive_latest
-- The latest archived events of the topics matching %(topics)s (a regular expression made from
-- globs), newest first, as the claim reads an event (`outbox transform test`). Delivered since
-- %(since)s: the caller widens the window until it has enough, so that the BRIN index on
-- delivered_at, not a sort of the whole archive, finds them.
SELECT d.id, d.event_id::text, d.topic, d.key, d.payload, nullif(d.headers, '{{}}'::jsonb)::text,
       extract(epoch FROM d.created_at)::float8, d.attempts, d.type, d.subject, NULL::float8, NULL::float8
FROM {schema}.delivered AS d
WHERE d.delivered_at >= %(since)s::timestamptz AND d.topic ~ %(topics)s
ORDER BY d.delivered_at DESC, d.id DESC
LIMIT %(limit)s
