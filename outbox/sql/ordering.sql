-- Named queries of partition ownership among live relays (outbox.ordering).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: relay_heartbeat
-- Register or refresh this relay, extend its partitions' leases, and list the live relays, in
-- one statement (one round trip, one transaction: a relay heartbeats every outbox it serves).
-- Returns the partitions it still owns, those being released, whether any is still fenced (a
-- previous owner's batch may hold its lock), and the ids of the live key-ordering relays in
-- join order. (A relay in --ordering none owns no partition; it uses the membership only.)
-- The list is read in the statement's snapshot, before the upsert: the relay counts itself
-- live, as its upsert makes it, in its place even when its membership had lapsed (on its first
-- heartbeat it is not there yet, and counts itself last, where its join puts it).
-- A lease that lapsed while no other relay took the partition is renewed too: nobody claimed
-- from it meanwhile (claims check the lease, and only the owner claims), so it is still ours.
-- Losing and taking it back would fence it behind this relay's own batches, and with many
-- outboxes on a starved machine that churn fed itself (heartbeats late, leases lapsed, fences).
WITH beat AS (
    INSERT INTO {schema}.relays (id, name, expires_at, lease_seconds, backend_pids, ordering, readiness)
    VALUES (%(me)s, %(name)s, now() + %(ttl)s * interval '1 second', %(lease)s,
            %(pids)s::text::integer[], %(ordering)s, %(readiness)s)
    ON CONFLICT (id) DO UPDATE
    SET heartbeat_at = now(), expires_at = excluded.expires_at, backend_pids = excluded.backend_pids,
        readiness = excluded.readiness
), renewed AS (
    UPDATE {schema}.partitions SET expires_at = now() + %(ttl)s * interval '1 second'
    WHERE owner = %(me)s
    RETURNING partition, releasing, fenced_until IS NOT NULL AS fenced
)
SELECT coalesce(array_agg(partition), '{{}}'),
       coalesce(array_agg(partition) FILTER (WHERE releasing), '{{}}'),
       coalesce(bool_or(fenced), false),
       ARRAY(SELECT id FROM {schema}.relays
             WHERE (expires_at > now() OR id = %(me)s) AND ordering = 'key'
             ORDER BY started_at, id)
FROM renewed

-- name: acquire_partitions
-- Take up to %(count)s partitions that are free or whose owner's lease expired.
-- A partition some batch still claims from (its advisory lock is held: see claim_batch) is
-- taken fenced: claimed from only once unfence_partitions finds the lock free. The previous
-- owner's batch may live on past its lease (a starved process whose finish() keeps the session
-- busy), and while it holds a key's event locked, SKIP LOCKED would hand its later events to
-- the new owner. No time bound is assumed; the lock is the truth.
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
-- Drop membership rows of relays that have been gone for a while.
DELETE FROM {schema}.relays WHERE expires_at < now() - interval '10 minutes'
