-- Named queries of the benchmark's baselines and probes (outbox/bench). Same
-- rules as queries.sql: {schema} is an identifier, values are parameters.

-- name: bare_claim
-- The bare loop: lock a batch in id order, no lease column, no ordering check.
SELECT id, event_id, topic, key, payload, headers
FROM {schema}.events
ORDER BY id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: seeds_claim
-- The seeds' loop: one row at a time.
SELECT id, event_id, topic, key, payload, headers
FROM {schema}.events
ORDER BY id
LIMIT 1
FOR UPDATE SKIP LOCKED

-- name: seeds_lease
-- The seeds' loop marks its claim on the row (their lease update).
UPDATE {schema}.events SET attempts = attempts + 1, available_at = now() + interval '30 seconds'
WHERE id = %s

-- name: seeds_delete
-- The seeds' loop deletes the published row.
DELETE FROM {schema}.events WHERE id = %s

-- name: ceiling_tables
-- The ceiling's own plain tables: no generated column, no partitions, no triggers.
CREATE TABLE {schema}.plain_events (
    id       bigserial PRIMARY KEY,
    event_id uuid      NOT NULL,
    topic    text      NOT NULL,
    key      bytea,
    payload  bytea     NOT NULL,
    headers  jsonb     NOT NULL DEFAULT '{{}}'
);
CREATE TABLE {schema}.plain_archive (
    id           bigint      NOT NULL,
    event_id     uuid        NOT NULL,
    topic        text        NOT NULL,
    key          bytea,
    payload      bytea       NOT NULL,
    headers      jsonb       NOT NULL,
    delivered_at timestamptz NOT NULL DEFAULT now()
)

-- name: ceiling_fill
-- The same events as the outbox's table (filled by enqueue_many), moved to the plain table.
WITH moved AS (DELETE FROM {schema}.events RETURNING id, event_id, topic, key, payload, headers)
INSERT INTO {schema}.plain_events (event_id, topic, key, payload, headers)
SELECT event_id, topic, key, payload, headers FROM moved ORDER BY id

-- name: ceiling_claim
SELECT id, event_id, topic, key, payload, headers
FROM {schema}.plain_events
ORDER BY id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED

-- name: ceiling_archive
WITH done AS (
    DELETE FROM {schema}.plain_events WHERE id = ANY(%(ids)s)
    RETURNING id, event_id, topic, key, payload, headers
)
INSERT INTO {schema}.plain_archive (id, event_id, topic, key, payload, headers)
SELECT id, event_id, topic, key, payload, headers FROM done

-- name: ceiling_analyze
ANALYZE {schema}.plain_events
