-- Named queries of the relay's hot path: claim a batch, then record what the sink said.
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: claim_batch
-- Ordered mode. Lock up to %(limit)s available events in id order, only from
-- partitions this relay owns (lease valid, not being released, not fenced).
-- The row locks are the batch's lease: they last until this transaction ends,
-- and idle_in_transaction_session_timeout ends a transaction whose worker
-- stalls. An event is skipped while an earlier event of its key awaits a retry
-- or is parked as a dead letter.
-- Each partition claimed from is also locked, shared, for the transaction (an advisory lock on
-- the partitions table's oid and the partition): a relay that takes the partition over claims
-- nothing from it until no batch holds that lock (acquire_partitions, unfence_partitions).
-- The lock is taken first and the lease checked after it, on the clock, partition by partition
-- (a join, not a subquery: PostgreSQL runs an uncorrelated subquery once, at its first use, so
-- after the first partition's lock but before the others'): a batch that claims from a
-- partition held its lock before the lease ran out, so before anyone could take it.
-- The lease is the relay's membership in the database (outbox_fleet.relays, migration 0018).
-- event_id comes as text, headers as JSON text (json.loads of a str is 1.6 us/row faster than
-- psycopg's jsonb loader) and empty headers as NULL. An expired event (expires_at, migration
-- 0023) is claimed like any other: the batch dead-letters it (kind expired), so that it leaves.
-- The last column is when the row's transaction committed, the latency's start, where PostgreSQL
-- keeps it (track_commit_timestamp on) and it is the writer's (a first attempt: a retry's update
-- is the row's newest transaction).
-- {skips}: while a batch out holds an event of a key locked, untouched, behind an earlier
-- failure, the key's events after it are skipped (claim_skips). Nearly never.
SELECT e.id, e.event_id::text, e.topic, e.key, e.payload, nullif(e.headers, '{{}}'::jsonb)::text,
       extract(epoch FROM e.created_at)::float8, e.attempts, e.type, e.subject,
       extract(epoch FROM e.expires_at)::float8,
       CASE WHEN e.attempts = 0 AND (SELECT current_setting('track_commit_timestamp')::bool)
            THEN extract(epoch FROM pg_xact_commit_timestamp(e.xmin))::float8 END
FROM {schema}.events AS e
WHERE e.available_at <= now()
  AND e.partition = ANY(ARRAY(
        SELECT p.partition FROM {schema}.partitions AS p
        JOIN outbox_fleet.relays AS f ON f.id = p.owner
        WHERE p.owner = %(owner)s
          AND CASE WHEN NOT p.releasing AND (p.fenced_until IS NULL OR p.fenced_until <= now())
                   THEN pg_try_advisory_xact_lock_shared(p.tableoid::integer, p.partition)
                        AND f.expires_at > clock_timestamp()
                   ELSE false END))
  -- Each per-key check is guarded by a one-time test (an init plan): when no
  -- event is retrying / no key is parked, the common case, no row pays a probe.
  -- The test reads the first row of the partial index in its order rather than
  -- EXISTS: without statistics (a backlog after an outage) the planner sent EXISTS
  -- through a scan of the whole events table, 100 ms per claim at 300,000 pending;
  -- an ordered LIMIT 1 takes the partial index with or without them.
  AND ((SELECT 1 FROM {schema}.events WHERE attempts > 0 ORDER BY key, id LIMIT 1) IS NULL
       OR NOT EXISTS (
            SELECT 1 FROM {schema}.events AS b
            WHERE b.attempts > 0 AND b.key = e.key AND b.id < e.id))
  AND ((SELECT 1 FROM {schema}.dead_letters WHERE parked ORDER BY key, id LIMIT 1) IS NULL
       OR NOT EXISTS (
            SELECT 1 FROM {schema}.dead_letters AS d
            WHERE d.parked AND d.key = e.key AND d.id < e.id))
  {skips}
  {limits}
ORDER BY e.id
LIMIT %(limit)s
FOR UPDATE OF e SKIP LOCKED

-- name: claim_skips
-- claim_batch's {skips} when a batch out holds an event of a key locked, untouched, behind an
-- earlier failure: %(skip_keys)s / %(skip_after)s, the key's events after it are skipped
-- (KeyHolds.skip_after), and wait for it. A fragment for the reason claim_limits_ordered is.
  AND NOT EXISTS (
            SELECT 1 FROM unnest(%(skip_keys)s::bytea[], %(skip_after)s::bigint[]) AS s(key, after)
            WHERE s.key = e.key AND e.id > s.after)

-- name: claim_limits_ordered
-- claim_batch's {limits} when the relay has limits (--limit): %(only)s, the topics of the one
-- limit this claim is for; %(skip)s, those it leaves (every limit's, or the earlier limits'). A
-- limited topic's events wait in the table, and so, in key order, do the later events of their
-- keys; a limited claim takes an event only when no earlier event of its key, of any other
-- topic, is still pending. A fragment, not a clause of every claim: "%(only)s IS NULL OR ..."
-- kept PostgreSQL from caching a generic plan, and every claim was planned anew (decision 0001).
  AND (%(only)s::text IS NULL OR e.topic ~ %(only)s::text)
  AND (%(skip)s::text IS NULL OR e.topic !~ %(skip)s::text)
  AND (%(skip)s::text IS NULL OR e.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {schema}.events AS w
            WHERE w.key = e.key AND w.id < e.id AND w.topic ~ %(skip)s::text))
  AND (%(only)s::text IS NULL OR e.key IS NULL OR NOT EXISTS (
            SELECT 1 FROM {schema}.events AS w
            WHERE w.key = e.key AND w.id < e.id AND w.topic !~ %(only)s::text))

-- name: claim_batch_unordered
-- Unordered mode: any available event, plain SKIP LOCKED, maximum parallelism ({limits}: of the
-- topics %(only)s names, but those %(skip)s names, as in claim_batch).
SELECT e.id, e.event_id::text, e.topic, e.key, e.payload, nullif(e.headers, '{{}}'::jsonb)::text,
       extract(epoch FROM e.created_at)::float8, e.attempts, e.type, e.subject,
       extract(epoch FROM e.expires_at)::float8,
       CASE WHEN e.attempts = 0 AND (SELECT current_setting('track_commit_timestamp')::bool)
            THEN extract(epoch FROM pg_xact_commit_timestamp(e.xmin))::float8 END
FROM {schema}.events AS e
WHERE e.available_at <= now()
  {limits}
ORDER BY e.id
LIMIT %(limit)s
FOR UPDATE OF e SKIP LOCKED

-- name: claim_limits
-- claim_batch_unordered's {limits} when the relay has limits (--limit).
  AND (%(only)s::text IS NULL OR e.topic ~ %(only)s::text)
  AND (%(skip)s::text IS NULL OR e.topic !~ %(skip)s::text)

-- name: archive_delivered
-- Move acked events to the archive with their sink coordinates, in one statement.
-- Integer arrays arrive as text literals ('{{1,2,NULL}}'), parsed by PostgreSQL. refs may be
-- empty (a sink without references), and filtered (what a transform dropped, migration 0022)
-- nearly always is: unnest pads the shorter arrays with NULLs.
WITH done AS (
    DELETE FROM {schema}.events AS e
    USING unnest(%(ids)s::text::bigint[], %(partitions)s::text::integer[], %(offsets)s::text::bigint[],
                 %(refs)s::text[], %(filtered)s::text[])
          AS r(id, sink_partition, sink_offset, sink_ref, filtered_by)
    WHERE e.id = r.id
    RETURNING e.id, e.event_id, e.topic, e.key, e.payload, e.headers, e.created_at,
              e.attempts + 1 AS attempts, r.sink_partition, r.sink_offset, r.sink_ref, e.type, e.subject,
              r.filtered_by
)
INSERT INTO {schema}.delivered
    (id, event_id, topic, key, payload, headers, created_at, attempts,
     sink_partition, sink_offset, sink_ref, type, subject, filtered_by)
SELECT id, event_id, topic, key, payload, headers, created_at, attempts,
       sink_partition, sink_offset, sink_ref, type, subject, filtered_by
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
    last_error_kind = r.kind,
    first_failed_at = coalesce(e.first_failed_at, clock_timestamp())
FROM unnest(%(ids)s::text::bigint[], %(delays)s::float8[], %(errors)s::text[], %(kinds)s::text[])
     AS r(id, delay, error, kind)
WHERE e.id = r.id

-- name: retry_unreachable_now
-- The sinks answer again: events whose last attempt failed only because a sink could not be
-- reached are due now, not at the end of their backoff. Returns how many.
-- SKIP LOCKED: a locked one is in a batch in flight (this relay's or another's), which settles
-- it. Waiting for its lock blocked the relay's loop on its own batch until the statement
-- timeout (20 s without claims after a fenced producer was replaced).
UPDATE {schema}.events AS e
SET available_at = now()
FROM (
    SELECT id FROM {schema}.events
    WHERE attempts > 0 AND available_at > now() AND last_error_kind = ANY(%(kinds)s::text[])
    FOR UPDATE SKIP LOCKED
) AS due
WHERE e.id = due.id

-- name: dead_letter
-- Move events that can never be delivered to dead_letters with their reason and its kind
-- (migration 0020); with %(park)s, a keyed dead letter parks the later events of its key, but
-- an expired one (migration 0023): its key's next event goes on.
WITH dead AS (
    DELETE FROM {schema}.events AS e
    USING unnest(%(ids)s::text::bigint[], %(errors)s::text[], %(kinds)s::text[]) AS r(id, error, kind)
    WHERE e.id = r.id
    RETURNING e.id, e.event_id, e.topic, e.key, e.payload, e.headers, e.created_at,
              e.attempts + 1 AS attempts, r.error, r.kind, e.first_failed_at, e.type, e.subject,
              e.expires_at
)
INSERT INTO {schema}.dead_letters
    (id, event_id, topic, key, payload, headers, created_at, attempts, error, kind,
     first_failed_at, failed_at, parked, type, subject, expires_at)
SELECT id, event_id, topic, key, payload, headers, created_at, attempts, error, kind,
       coalesce(first_failed_at, clock_timestamp()), clock_timestamp(),
       %(park)s AND key IS NOT NULL AND kind IS DISTINCT FROM 'expired', type, subject, expires_at
FROM dead

-- name: ensure_partitions
-- Create the archive's day partitions from yesterday to a few days ahead.
SELECT {schema}.ensure_delivered_partitions()

-- name: partitions_missing
-- Of the outboxes (schemas) %(schemas)s, those missing a day partition of the archive that
-- ensure_delivered_partitions() creates (yesterday to %(days)s days ahead, UTC): one look for a
-- relay's many outboxes, where a call each was a transaction each.
SELECT s.name
FROM unnest(%(schemas)s::text[]) AS s(name)
WHERE EXISTS (
    SELECT 1
    FROM generate_series((now() AT TIME ZONE 'UTC')::date - 1, (now() AT TIME ZONE 'UTC')::date + %(days)s,
                         interval '1 day') AS d(day)
    WHERE to_regclass(format('%%I.%%I', s.name, 'delivered_p' || to_char(d.day, 'YYYYMMDD'))) IS NULL)

-- name: server_pid
-- The server process of this session (outbox.pooling: does a session keep its own?).
SELECT pg_backend_pid()
