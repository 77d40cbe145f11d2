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
-- Ordered mode. Lock up to %(limit)s available events in id order, only from
-- partitions this relay owns (lease valid, not being released, not fenced).
-- The row locks are the batch's lease: they last until this transaction ends,
-- and idle_in_transaction_session_timeout ends a transaction whose worker
-- stalls. An event is skipped while an earlier event of its key awaits a retry
-- or is parked as a dead letter.
-- event_id comes as text and empty headers as NULL: no per-row parsing in Python.
SELECT e.id, e.event_id::text, e.topic, e.key, e.payload, nullif(e.headers, '{{}}'::jsonb),
       e.created_at, e.attempts
FROM {schema}.events AS e
WHERE e.available_at <= now()
  AND e.partition = ANY(ARRAY(
        SELECT p.partition FROM {schema}.partitions AS p
        WHERE p.owner = %(owner)s AND p.expires_at > now() AND NOT p.releasing
          AND (p.fenced_until IS NULL OR p.fenced_until <= now())))
  -- Each per-key check is guarded by a one-time EXISTS (an init plan): when no
  -- event is retrying / no key is parked, the common case, no row pays a probe.
  AND (NOT EXISTS (SELECT 1 FROM {schema}.events WHERE attempts > 0)
       OR NOT EXISTS (
            SELECT 1 FROM {schema}.events AS b
            WHERE b.attempts > 0 AND b.key = e.key AND b.id < e.id))
  AND (NOT EXISTS (SELECT 1 FROM {schema}.dead_letters WHERE parked)
       OR NOT EXISTS (
            SELECT 1 FROM {schema}.dead_letters AS d
            WHERE d.parked AND d.key = e.key AND d.id < e.id))
ORDER BY e.id
LIMIT %(limit)s
FOR UPDATE OF e SKIP LOCKED

-- name: claim_batch_unordered
-- Unordered mode: any available event, plain SKIP LOCKED, maximum parallelism.
SELECT e.id, e.event_id::text, e.topic, e.key, e.payload, nullif(e.headers, '{{}}'::jsonb),
       e.created_at, e.attempts
FROM {schema}.events AS e
WHERE e.available_at <= now()
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
-- Move events that can never be delivered to dead_letters with their reason;
-- with %(park)s, a keyed dead letter parks the later events of its key.
WITH dead AS (
    DELETE FROM {schema}.events AS e
    USING unnest(%(ids)s::text::bigint[], %(errors)s::text[]) AS r(id, error)
    WHERE e.id = r.id
    RETURNING e.id, e.event_id, e.topic, e.key, e.payload, e.headers, e.created_at,
              e.attempts + 1 AS attempts, r.error, e.first_failed_at
)
INSERT INTO {schema}.dead_letters
    (id, event_id, topic, key, payload, headers, created_at, attempts, error,
     first_failed_at, failed_at, parked)
SELECT id, event_id, topic, key, payload, headers, created_at, attempts, error,
       coalesce(first_failed_at, clock_timestamp()), clock_timestamp(),
       %(park)s AND key IS NOT NULL
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

-- name: status_parked_keys
-- Keys held back by a parked dead letter, with how many events wait behind it.
SELECT d.key, d.topic, d.id, d.error,
       (SELECT count(*) FROM {schema}.events AS e WHERE e.key = d.key AND e.id > d.id) AS waiting
FROM {schema}.dead_letters AS d
WHERE d.parked
ORDER BY d.id
LIMIT 50

-- name: status_owners
-- Which relay owns which partitions now.
SELECT r.id::text, r.name, r.ordering, r.heartbeat_at,
       coalesce(array_agg(p.partition ORDER BY p.partition)
                FILTER (WHERE p.partition IS NOT NULL), '{{}}') AS partitions
FROM {schema}.relays AS r
LEFT JOIN {schema}.partitions AS p ON p.owner = r.id AND p.expires_at > now()
WHERE r.expires_at > now()
GROUP BY r.id, r.name, r.ordering, r.heartbeat_at
ORDER BY r.started_at, r.id

-- name: status_unowned
-- Partitions no live relay owns.
SELECT count(*) FROM {schema}.partitions
WHERE owner IS NULL OR expires_at IS NULL OR expires_at <= now()

-- name: dead_list
-- Dead letters, optionally of one topic and/or key, with the events parked behind each.
SELECT d.id, d.event_id::text, d.topic, d.key, d.attempts, d.error, d.failed_at, d.parked,
       (SELECT count(*) FROM {schema}.events AS e WHERE e.key = d.key AND e.id > d.id) AS waiting
FROM {schema}.dead_letters AS d
WHERE (%(topic)s::text IS NULL OR d.topic = %(topic)s)
  AND (%(key)s::bytea IS NULL OR d.key = %(key)s)
ORDER BY d.id
LIMIT %(limit)s

-- name: dead_select
-- Ids of dead letters chosen by id list, key, or all.
SELECT id FROM {schema}.dead_letters
WHERE (%(all)s OR id = ANY(%(ids)s::text::bigint[]) OR (%(key)s::bytea IS NOT NULL AND key = %(key)s))

-- name: dead_redrive
-- Put dead letters back into events under their original id (the head of their key).
WITH moved AS (
    DELETE FROM {schema}.dead_letters AS d
    WHERE d.id = ANY(%(ids)s::text::bigint[])
    RETURNING d.id, d.event_id, d.topic, d.key, d.payload, d.headers, d.created_at
)
INSERT INTO {schema}.events (id, event_id, topic, key, payload, headers, created_at, available_at, attempts)
OVERRIDING SYSTEM VALUE
SELECT id, event_id, topic, key, coalesce(payload, ''::bytea), coalesce(headers, '{{}}'::jsonb),
       created_at, now(), 0
FROM moved

-- name: dead_skip
-- Give dead letters up: keep them, release the events parked behind them.
UPDATE {schema}.dead_letters SET parked = false
WHERE id = ANY(%(ids)s::text::bigint[]) AND parked

-- name: relay_heartbeat
-- Register or refresh this relay; returns the live relays in a stable order.
INSERT INTO {schema}.relays (id, name, expires_at, lease_seconds, backend_pids, ordering)
VALUES (%(me)s, %(name)s, now() + %(ttl)s * interval '1 second', %(lease)s,
        %(pids)s::text::integer[], %(ordering)s)
ON CONFLICT (id) DO UPDATE
SET heartbeat_at = now(), expires_at = excluded.expires_at, backend_pids = excluded.backend_pids

-- name: live_relays
-- Ids of relays whose membership has not expired, in join order.
SELECT id FROM {schema}.relays WHERE expires_at > now() AND ordering = 'key'
ORDER BY started_at, id

-- name: renew_partitions
-- Extend this relay's leases; returns the partitions it still owns.
UPDATE {schema}.partitions SET expires_at = now() + %(ttl)s * interval '1 second'
WHERE owner = %(me)s AND expires_at > now()
RETURNING partition, releasing

-- name: acquire_partitions
-- Take up to %(count)s partitions that are free or whose owner's lease expired.
-- From an expired owner, a partition stays fenced for that owner's batch lease
-- (its stalled batch may still hold row locks) unless its sessions are gone.
WITH free AS (
    SELECT p.partition, p.owner AS previous
    FROM {schema}.partitions AS p
    WHERE p.owner IS NULL OR p.expires_at <= now()
    ORDER BY p.partition
    LIMIT %(count)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.partitions AS p
SET owner = %(me)s,
    expires_at = now() + %(ttl)s * interval '1 second',
    releasing = false,
    acquired_at = now(),
    previous_owner = f.previous,
    fenced_until = CASE
        WHEN f.previous IS NULL THEN NULL
        WHEN NOT EXISTS (
            SELECT 1 FROM {schema}.relays AS r JOIN pg_stat_activity AS a ON a.pid = ANY(r.backend_pids)
            WHERE r.id = f.previous) THEN NULL
        ELSE now() + coalesce((SELECT r.lease_seconds FROM {schema}.relays AS r WHERE r.id = f.previous),
                              %(max_lease)s) * interval '1 second'
    END
FROM free AS f
WHERE p.partition = f.partition
RETURNING p.partition

-- name: unfence_partitions
-- Lift the fence early once the previous owner's sessions are all gone.
UPDATE {schema}.partitions AS p SET fenced_until = NULL
WHERE p.owner = %(me)s AND p.fenced_until > now()
  AND NOT EXISTS (
        SELECT 1 FROM {schema}.relays AS r JOIN pg_stat_activity AS a ON a.pid = ANY(r.backend_pids)
        WHERE r.id = p.previous_owner)

-- name: mark_releasing
-- Stop claiming from some partitions (handed over once in-flight batches finish).
UPDATE {schema}.partitions SET releasing = true
WHERE owner = %(me)s AND partition = ANY(%(parts)s::text::smallint[])

-- name: release_partitions
-- Hand partitions over: their rows are no longer locked by this relay.
UPDATE {schema}.partitions
SET owner = NULL, expires_at = NULL, releasing = false, fenced_until = NULL
WHERE owner = %(me)s AND partition = ANY(%(parts)s::text::smallint[])

-- name: release_all
-- Clean shutdown: hand every partition over and leave the membership.
WITH gone AS (DELETE FROM {schema}.relays WHERE id = %(me)s)
UPDATE {schema}.partitions
SET owner = NULL, expires_at = NULL, releasing = false, fenced_until = NULL
WHERE owner = %(me)s

-- name: forget_relays
-- Drop membership rows of relays that have been gone for a while.
DELETE FROM {schema}.relays WHERE expires_at < now() - interval '10 minutes'

-- name: hot_table_stats
-- Dead and live tuples (statistics) and size of the hot events table.
SELECT coalesce(s.n_dead_tup, 0), coalesce(s.n_live_tup, 0),
       pg_total_relation_size(format('%%I.events', %(schema)s::text)::regclass)
FROM (SELECT 1) AS one
LEFT JOIN pg_stat_user_tables AS s ON s.schemaname = %(schema)s AND s.relname = 'events'

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

-- name: oldest_xmin_age
-- Seconds since the oldest transaction that holds back vacuum started (NULL if none).
SELECT extract(epoch FROM now() - min(xact_start))::float8
FROM pg_stat_activity
WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid() AND datname = current_database()

-- name: retry_select
-- Dead letters to retry: by topic, error pattern and/or ids (all when no filter).
SELECT id FROM {schema}.dead_letters
WHERE (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(error_like)s::text IS NULL OR error LIKE %(error_like)s)
  AND (%(ids)s::text IS NULL OR id = ANY(%(ids)s::text::bigint[]))
ORDER BY id

-- name: replay_count
-- How many archived events a replay would re-send.
SELECT count(*) FROM {schema}.delivered
WHERE delivered_at >= %(since)s AND delivered_at < %(until)s
  AND (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(key)s::bytea IS NULL OR key = %(key)s)

-- name: replay_chunk
-- Re-send the next chunk of archived events (in delivery order) as new events:
-- a new event-id, and header outbox-replay-of = the original event-id.
-- Returns how many were queued and where the chunk ended.
WITH src AS (
    SELECT id, event_id, topic, key, payload, headers, delivered_at
    FROM {schema}.delivered
    WHERE delivered_at >= %(since)s AND delivered_at < %(until)s
      AND (%(topic)s::text IS NULL OR topic = %(topic)s)
      AND (%(key)s::bytea IS NULL OR key = %(key)s)
      AND (delivered_at, id) > (%(after_at)s::timestamptz, %(after_id)s::bigint)
    ORDER BY delivered_at, id
    LIMIT %(limit)s
), queued AS (
    INSERT INTO {schema}.events (event_id, topic, key, payload, headers)
    SELECT gen_random_uuid(), topic, key, payload,
           headers || jsonb_build_object('outbox-replay-of', event_id::text)
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
