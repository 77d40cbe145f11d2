-- Named queries of dead letters and parked keys (outbox.dead).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: dead_select
-- Ids of the dead letters a selector chooses. Every filter given narrows the
-- choice (ids, key, topic, error LIKE pattern); with none, every dead letter.
SELECT id FROM {schema}.dead_letters
WHERE (%(ids)s::text IS NULL OR id = ANY(%(ids)s::text::bigint[]))
  AND (%(key)s::bytea IS NULL OR key = %(key)s)
  AND (%(topic)s::text IS NULL OR topic = %(topic)s)
  AND (%(error_like)s::text IS NULL OR error LIKE %(error_like)s)
ORDER BY id

-- name: dead_list
-- Chosen dead letters in detail, with the number of events parked behind each.
SELECT d.id, d.event_id::text, d.topic, d.key, d.attempts, d.error, d.failed_at, d.parked,
       (SELECT count(*) FROM {schema}.events AS e WHERE e.key = d.key AND e.id > d.id) AS waiting
FROM {schema}.dead_letters AS d
WHERE d.id = ANY(%(ids)s::text::bigint[])
ORDER BY d.id

-- name: dead_redrive
-- Put dead letters back into events under their original id (the head of their key).
WITH moved AS (
    DELETE FROM {schema}.dead_letters AS d
    WHERE d.id = ANY(%(ids)s::text::bigint[])
    RETURNING d.id, d.event_id, d.topic, d.key, d.payload, d.headers, d.created_at, d.type, d.subject
)
INSERT INTO {schema}.events
    (id, event_id, topic, key, payload, headers, created_at, available_at, attempts, type, subject)
OVERRIDING SYSTEM VALUE
SELECT id, event_id, topic, key, coalesce(payload, ''::bytea), coalesce(headers, '{{}}'::jsonb),
       created_at, now(), 0, type, subject
FROM moved

-- name: dead_skip
-- Give dead letters up: keep them, release the events parked behind them.
UPDATE {schema}.dead_letters SET parked = false
WHERE id = ANY(%(ids)s::text::bigint[]) AND parked
