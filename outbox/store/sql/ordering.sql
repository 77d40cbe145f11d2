-- Named queries of partition ownership among live relays (outbox.ordering).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: lane_tick
-- One outbox's ownership, looked at: register this relay in the outbox (its join order decides
-- the shares), and list the partitions it owns, those being released, whether any is still
-- fenced (a previous owner's batch may hold its lock), and the live key-ordering relays of the
-- outbox in join order. Live: its membership in the database (outbox_fleet.relays, renewed by
-- fleet_heartbeat) has not expired. Nothing here renews a lease: a relay's leases in every
-- outbox of a database are its one membership row (migration 0018).
-- The list is read in the statement's snapshot, before the upsert: on its first look the relay
-- is not registered yet and counts itself last, where its registration puts it.
-- `expires_at` here only tells relays of an earlier version that this one is alive.
WITH beat AS (
    INSERT INTO {schema}.relays (id, name, expires_at, lease_seconds, ordering)
    VALUES (%(me)s, %(name)s, now() + %(ttl)s * interval '1 second', %(lease)s, %(ordering)s)
    ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), expires_at = excluded.expires_at
), mine AS (
    SELECT partition, releasing, fenced_until IS NOT NULL AS fenced
    FROM {schema}.partitions WHERE owner = %(me)s
)
SELECT coalesce(array_agg(partition), '{{}}'),
       coalesce(array_agg(partition) FILTER (WHERE releasing), '{{}}'),
       coalesce(bool_or(fenced), false),
       ARRAY(SELECT r.id FROM {schema}.relays AS r
             JOIN outbox_fleet.relays AS f ON f.id = r.id
             WHERE (f.expires_at > now() OR r.id = %(me)s) AND r.ordering = 'key'
             ORDER BY r.started_at, r.id)
FROM mine

-- name: acquire_partitions
-- Take up to %(count)s partitions that are free or whose owner's lease expired: its membership
-- (outbox_fleet.relays) expired or is gone. A partition of a relay of an earlier version (no
-- membership; it renews `expires_at` itself) is free once that has passed; this version's are
-- 'infinity', which such a relay never takes.
-- A partition some batch still claims from (its advisory lock is held: see claim_batch) is
-- taken fenced: claimed from only once unfence_partitions finds the lock free. The previous
-- owner's batch may live on past its lease (a starved process whose finish() keeps the session
-- busy), and while it holds a key's event locked, SKIP LOCKED would hand its later events to
-- the new owner. No time bound is assumed; the lock is the truth.
WITH free AS (
    SELECT p.partition, p.owner AS previous
    FROM {schema}.partitions AS p
    WHERE p.owner IS NULL
       OR (NOT EXISTS (SELECT 1 FROM outbox_fleet.relays AS f WHERE f.id = p.owner AND f.expires_at > now())
           AND (p.expires_at IS NULL OR p.expires_at <= now() OR p.expires_at = 'infinity'))
    ORDER BY p.partition
    LIMIT %(count)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {schema}.partitions AS p
SET owner = %(me)s,
    expires_at = 'infinity',
    releasing = false,
    acquired_at = now(),
    previous_owner = f.previous,
    fenced_until = CASE WHEN pg_try_advisory_xact_lock(p.tableoid::integer, p.partition)
                        THEN NULL ELSE 'infinity'::timestamptz END
FROM free AS f
WHERE p.partition = f.partition
RETURNING p.partition, p.fenced_until IS NOT NULL

-- name: unfence_partitions
-- Lift the fence of this relay's partitions that no batch claims from any more (their advisory
-- lock is free: the previous owner's batches have ended, or its sessions are gone).
UPDATE {schema}.partitions AS p SET fenced_until = NULL
WHERE CASE WHEN p.owner = %(me)s AND p.fenced_until > now()
           THEN pg_try_advisory_xact_lock(p.tableoid::integer, p.partition)
           ELSE false END

-- name: end_fencing_sessions
-- End the sessions that still hold the advisory lock of a partition this relay took over more
-- than %(grace)s seconds ago (its batch lease). A previous owner's batch that lives that long
-- is stuck (a stopped process the server is blocked writing to: no timeout ends that) or
-- starved; ended, it can acknowledge nothing, and what it already sent is an earlier duplicate
-- of what this relay sends next. Returns how many it signalled.
SELECT count(*) FILTER (WHERE pg_terminate_backend(l.pid))
FROM {schema}.partitions AS p
JOIN pg_locks AS l
  ON l.locktype = 'advisory' AND l.classid = p.tableoid AND l.objid = p.partition::integer::oid
 AND l.objsubid = 2 AND l.granted
 AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
WHERE p.owner = %(me)s AND p.fenced_until > now()
  AND p.acquired_at < now() - %(grace)s * interval '1 second'
  AND l.pid <> pg_backend_pid()

-- name: end_stale_sessions
-- End this relay's sessions that it lost (a blackhole, a half-open connection) but that the
-- server still runs, maybe idle in a transaction with row locks; identified by pid and start
-- time, so a reused pid is never touched. Returns how many it signalled.
SELECT count(*) FILTER (WHERE pg_terminate_backend(a.pid))
FROM pg_stat_activity AS a
JOIN unnest(%(stale_pids)s::text::integer[], %(stale_starts)s::timestamptz[]) AS st(pid, started)
  ON a.pid = st.pid AND a.backend_start = st.started

-- name: stale_sessions_alive
-- How many of this relay's lost sessions the server still runs.
SELECT count(*)
FROM pg_stat_activity AS a
JOIN unnest(%(stale_pids)s::text::integer[], %(stale_starts)s::timestamptz[]) AS st(pid, started)
  ON a.pid = st.pid AND a.backend_start = st.started

-- name: backend_start
-- This session's server pid and start time (which identify it if it is ever lost), read from the
-- server: behind PgBouncer, the pid the client library was told is the pooler's, not the
-- server's. It also gives the session its settings (see outbox.sessions): as statements, not
-- as the startup packet's `options`, which PgBouncer refuses.
SELECT pid, backend_start,
       set_config('idle_in_transaction_session_timeout', %(lease_ms)s, false),
       set_config('statement_timeout', %(lease_ms)s, false),
       set_config('jit', 'off', false),
       set_config('enable_sort', 'off', false)
FROM pg_stat_activity WHERE pid = pg_backend_pid()

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
-- Drop the rows of relays that have been gone from the outbox's database for a while.
DELETE FROM {schema}.relays AS r
WHERE r.expires_at < now() - interval '10 minutes'
  AND NOT EXISTS (SELECT 1 FROM outbox_fleet.relays AS f
                  WHERE f.id = r.id AND f.expires_at > now() - interval '10 minutes')
