-- Named queries of the outbox. Each block starts with `-- name: <name>` and a
-- one-line comment. {schema} is replaced by the schema identifier (psycopg.sql),
-- never by string formatting; every value is a bound parameter.

-- name: insert_event
-- One event, written by the application inside its own transaction.
INSERT INTO {schema}.events (event_id, topic, key, payload, headers, available_at)
VALUES (%s, %s, %s, %s, %s, now() + %s * interval '1 second')

-- name: copy_events
-- Many events without delay, streamed with COPY (binary).
COPY {schema}.events (event_id, topic, key, payload, headers) FROM STDIN (FORMAT BINARY)

-- name: events_table
-- The events table of a schema, or NULL when the schema has not been migrated.
SELECT to_regclass(format('%%I.events', %s::text)) IS NOT NULL

-- name: claim_batch
-- Lock up to %(limit)s available events in id order. The row locks are the lease:
-- they last until this transaction ends, and idle_in_transaction_session_timeout
-- ends a transaction whose worker stalls past the lease. An event is skipped while
-- an earlier event of its key has failed and awaits its retry (per-key order).
-- event_id comes as text and empty headers as NULL: no per-row parsing in Python.
SELECT e.id, e.event_id::text, e.topic, e.key, e.payload, nullif(e.headers, '{{}}'::jsonb),
       e.created_at, e.attempts
FROM {schema}.events AS e
WHERE e.available_at <= now()
  AND NOT EXISTS (
        SELECT 1 FROM {schema}.events AS b
        WHERE b.attempts > 0 AND b.key = e.key AND b.id < e.id)
ORDER BY e.id
LIMIT %(limit)s
FOR UPDATE OF e SKIP LOCKED

-- name: archive_delivered
-- Move acked events to the archive with their sink coordinates, in one statement.
-- Integer arrays arrive as text literals ('{{1,2,NULL}}'), parsed by PostgreSQL.
WITH done AS (
    DELETE FROM {schema}.events AS e
    USING unnest(%(ids)s::text::bigint[], %(partitions)s::text::integer[], %(offsets)s::text::bigint[])
          AS r(id, sink_partition, sink_offset)
    WHERE e.id = r.id
    RETURNING e.id, e.event_id, e.topic, e.key, e.payload, e.headers, e.created_at,
              e.attempts + 1 AS attempts, r.sink_partition, r.sink_offset
)
INSERT INTO {schema}.delivered
    (id, event_id, topic, key, payload, headers, created_at, attempts,
     sink_partition, sink_offset)
SELECT id, event_id, topic, key, payload, headers, created_at, attempts,
       sink_partition, sink_offset
FROM done

-- name: delete_delivered
-- Forget acked events (archive switched off).
DELETE FROM {schema}.events WHERE id = ANY(%(ids)s::text::bigint[])

-- name: schedule_retry
-- Persist a failed attempt: count it, keep the error, and set the next attempt time.
UPDATE {schema}.events AS e
SET attempts = e.attempts + 1,
    available_at = clock_timestamp() + r.delay * interval '1 second',
    last_error = r.error,
    first_failed_at = coalesce(e.first_failed_at, clock_timestamp())
FROM unnest(%(ids)s::text::bigint[], %(delays)s::float8[], %(errors)s::text[]) AS r(id, delay, error)
WHERE e.id = r.id

-- name: dead_letter
-- Move events that can never be delivered to dead_letters with their reason.
WITH dead AS (
    DELETE FROM {schema}.events AS e
    USING unnest(%(ids)s::text::bigint[], %(errors)s::text[]) AS r(id, error)
    WHERE e.id = r.id
    RETURNING e.id, e.event_id, e.topic, e.key, e.payload, e.headers, e.created_at,
              e.attempts + 1 AS attempts, r.error, e.first_failed_at
)
INSERT INTO {schema}.dead_letters
    (id, event_id, topic, key, payload, headers, created_at, attempts, error,
     first_failed_at, failed_at)
SELECT id, event_id, topic, key, payload, headers, created_at, attempts, error,
       coalesce(first_failed_at, clock_timestamp()), clock_timestamp()
FROM dead

-- name: ensure_partitions
-- Create the archive's day partitions from yesterday to a few days ahead.
SELECT {schema}.ensure_delivered_partitions()

-- name: status_counts
-- Depth, retrying, dead and delivered counts, and the age of the oldest pending event.
SELECT
    (SELECT count(*) FROM {schema}.events) AS pending,
    (SELECT count(*) FROM {schema}.events WHERE attempts > 0) AS retrying,
    (SELECT count(*) FROM {schema}.dead_letters) AS dead,
    (SELECT count(*) FROM {schema}.delivered) AS delivered,
    (SELECT extract(epoch FROM clock_timestamp() - min(created_at))::float8
       FROM {schema}.events) AS oldest_pending_age_seconds

-- name: status_by_topic
-- Pending events per topic, with the oldest one's age.
SELECT topic, count(*) AS pending,
       extract(epoch FROM clock_timestamp() - min(created_at))::float8 AS oldest_age_seconds
FROM {schema}.events
GROUP BY topic
ORDER BY count(*) DESC, topic

-- name: status_errors
-- The most frequent last errors of events that are waiting for a retry.
SELECT last_error, count(*) AS events
FROM {schema}.events
WHERE last_error IS NOT NULL
GROUP BY last_error
ORDER BY count(*) DESC, last_error
LIMIT 10

-- name: status_delivered_last_hour
-- Events archived in the last hour.
SELECT count(*) FROM {schema}.delivered WHERE delivered_at > now() - interval '1 hour'
