-- Named queries of dead letters and parked keys (outbox.dead).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: dead_select
-- Ids of the dead letters a selector chooses (outbox.dead.Selector: the CLI's and the console's
-- one selection). Every filter given narrows the choice: ids, key, topic, an error LIKE
-- pattern, an error substring (any case), the fingerprint, a failure-time window, and the
-- high-water mark (made up to this seq: a console page's); with none, every dead letter. A
-- message the relay could not verify as an event of this outbox (unsigned_event, corrupt_event:
-- migration 0020) only with %(unverified)s: a redrive takes one only by id, knowingly. An
-- expired one (migration 0023) only with %(expired)s: a redrive delivers it late only when asked.
SELECT id FROM {schema}.dead_letters AS d
WHERE (%(ids)s::text IS NULL OR d.id = ANY(%(ids)s::text::bigint[]))
  AND (%(key)s::bytea IS NULL OR d.key = %(key)s)
  AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
  AND (%(error_like)s::text IS NULL OR d.error LIKE %(error_like)s)
  AND (%(error)s::text IS NULL OR strpos(lower(d.error), lower(%(error)s)) > 0)
  AND (%(fingerprint)s::text IS NULL OR d.fingerprint = %(fingerprint)s)
  AND (%(since)s::timestamptz IS NULL OR d.failed_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR d.failed_at < %(until)s)
  AND (%(high_water)s::bigint IS NULL OR d.seq <= %(high_water)s)
  AND (%(unverified)s::boolean OR d.kind IS NULL OR d.kind <> ALL(%(unverified_kinds)s::text[]))
  AND (%(expired)s::boolean OR d.kind IS DISTINCT FROM 'expired')
  AND d.id > %(after)s
ORDER BY d.id
LIMIT %(limit)s

-- name: dead_count
-- How many dead letters a selector chooses (dead_select's filters).
SELECT count(*) FROM {schema}.dead_letters AS d
WHERE (%(ids)s::text IS NULL OR d.id = ANY(%(ids)s::text::bigint[]))
  AND (%(key)s::bytea IS NULL OR d.key = %(key)s)
  AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
  AND (%(error_like)s::text IS NULL OR d.error LIKE %(error_like)s)
  AND (%(error)s::text IS NULL OR strpos(lower(d.error), lower(%(error)s)) > 0)
  AND (%(fingerprint)s::text IS NULL OR d.fingerprint = %(fingerprint)s)
  AND (%(since)s::timestamptz IS NULL OR d.failed_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR d.failed_at < %(until)s)
  AND (%(high_water)s::bigint IS NULL OR d.seq <= %(high_water)s)
  AND (%(unverified)s::boolean OR d.kind IS NULL OR d.kind <> ALL(%(unverified_kinds)s::text[]))
  AND (%(expired)s::boolean OR d.kind IS DISTINCT FROM 'expired')

-- name: dead_list
-- Chosen dead letters in detail, with the number of events parked behind each.
SELECT d.id, d.event_id::text, d.topic, d.key, d.attempts, d.error, d.failed_at, d.parked,
       (SELECT count(*) FROM {schema}.events AS e WHERE e.key = d.key AND e.id > d.id) AS waiting, d.kind
FROM {schema}.dead_letters AS d
WHERE d.id = ANY(%(ids)s::text::bigint[])
ORDER BY d.id

-- name: dead_redrive
-- Put dead letters back into events under their original id (the head of their key); one that
-- is no verified event of this outbox (dead_select) only with %(unverified)s, an expired one
-- (migration 0023) only with %(expired)s, and then without its expiry: it is to be delivered
-- late, knowingly. Any other keeps its expires_at.
WITH moved AS (
    DELETE FROM {schema}.dead_letters AS d
    WHERE d.id = ANY(%(ids)s::text::bigint[])
      AND (%(unverified)s::boolean OR d.kind IS NULL OR d.kind <> ALL(%(unverified_kinds)s::text[]))
      AND (%(expired)s::boolean OR d.kind IS DISTINCT FROM 'expired')
    RETURNING d.id, d.event_id, d.topic, d.key, d.payload, d.headers, d.created_at, d.type, d.subject,
              CASE WHEN d.kind = 'expired' THEN NULL ELSE d.expires_at END AS expires_at
)
INSERT INTO {schema}.events
    (id, event_id, topic, key, payload, headers, created_at, available_at, attempts, type, subject,
     expires_at)
OVERRIDING SYSTEM VALUE
SELECT id, event_id, topic, key, coalesce(payload, ''::bytea), coalesce(headers, '{{}}'::jsonb),
       created_at, now(), 0, type, subject, expires_at
FROM moved

-- name: dead_skip
-- Give dead letters up: keep them, release the events parked behind them.
UPDATE {schema}.dead_letters SET parked = false
WHERE id = ANY(%(ids)s::text::bigint[]) AND parked
