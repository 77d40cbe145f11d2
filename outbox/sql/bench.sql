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
