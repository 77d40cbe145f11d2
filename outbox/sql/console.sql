-- Named queries of the operator console (outbox.console).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is the schema as an
-- identifier (psycopg.sql); every value is a bound parameter. Literal braces are doubled.

-- name: console_topics
-- Per topic with anything pending, dead, or delivered in the last hour: events pending (first
-- attempt due), retrying, dead letters, parked keys, the oldest pending age, delivered last hour.
WITH ev AS (
    SELECT topic, count(*) FILTER (WHERE attempts = 0) AS pending,
           count(*) FILTER (WHERE attempts > 0) AS retrying,
           extract(epoch FROM clock_timestamp() - min(created_at))::float8 AS oldest
    FROM {schema}.events GROUP BY topic
), dl AS (
    SELECT topic, count(*) AS dead, count(DISTINCT key) FILTER (WHERE parked) AS parked_keys
    FROM {schema}.dead_letters GROUP BY topic
), hour AS (
    SELECT topic, count(*) AS delivered
    FROM {schema}.delivered WHERE delivered_at > now() - interval '1 hour' GROUP BY topic
)
SELECT coalesce(ev.topic, dl.topic, hour.topic) AS topic, coalesce(ev.pending, 0),
       coalesce(ev.retrying, 0), coalesce(dl.dead, 0), coalesce(dl.parked_keys, 0), ev.oldest,
       coalesce(hour.delivered, 0)
FROM ev FULL JOIN dl ON dl.topic = ev.topic
FULL JOIN hour ON hour.topic = coalesce(ev.topic, dl.topic)
ORDER BY 1

-- name: console_delivered_per_minute
-- Events archived per topic and minute over the last hour (the overview's chart).
SELECT topic, extract(epoch FROM date_trunc('minute', delivered_at))::bigint AS minute, count(*)
FROM {schema}.delivered
WHERE delivered_at > date_trunc('minute', now()) - interval '59 minutes'
GROUP BY 1, 2
ORDER BY 1, 2

-- name: console_dead_groups
-- Dead letters grouped by topic and error fingerprint (the error with ids and numbers masked),
-- filtered; each group's count, first and last failure, keys it parks and its highest id.
WITH chosen AS (
    SELECT d.*, regexp_replace(regexp_replace(d.error,
               '[0-9a-fA-F]{{8}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{12}}',
               '<id>', 'g'), '[0-9]+', '<n>', 'g') AS fingerprint
    FROM {schema}.dead_letters AS d
    WHERE d.id <= %(high_water)s
      AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
      AND (%(key)s::bytea IS NULL OR d.key = %(key)s)
      AND (%(error)s::text IS NULL OR strpos(lower(d.error), lower(%(error)s)) > 0)
      AND (%(since)s::timestamptz IS NULL OR d.failed_at >= %(since)s)
      AND (%(until)s::timestamptz IS NULL OR d.failed_at < %(until)s)
)
SELECT topic, fingerprint, split_part(fingerprint, ':', 1) AS kind, count(*), min(failed_at),
       max(failed_at), count(DISTINCT key) FILTER (WHERE parked), max(id),
       (array_agg(key ORDER BY id) FILTER (WHERE parked))[1:5]
FROM chosen
GROUP BY topic, fingerprint
ORDER BY count(*) DESC, topic, fingerprint
LIMIT 200

-- name: console_dead_high_water
-- The highest dead-letter id now: what a page shows and what its actions may touch.
SELECT coalesce(max(id), 0) FROM {schema}.dead_letters

-- name: console_dead_select
-- Ids of the dead letters a console selector chooses, up to the page's high-water mark.
SELECT id FROM {schema}.dead_letters AS d
WHERE d.id <= %(high_water)s
  AND (%(ids)s::text IS NULL OR d.id = ANY(%(ids)s::text::bigint[]))
  AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
  AND (%(key)s::bytea IS NULL OR d.key = %(key)s)
  AND (%(error)s::text IS NULL OR strpos(lower(d.error), lower(%(error)s)) > 0)
  AND (%(since)s::timestamptz IS NULL OR d.failed_at >= %(since)s)
  AND (%(until)s::timestamptz IS NULL OR d.failed_at < %(until)s)
  AND (%(fingerprint)s::text IS NULL OR regexp_replace(regexp_replace(d.error,
          '[0-9a-fA-F]{{8}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{4}}-[0-9a-fA-F]{{12}}',
          '<id>', 'g'), '[0-9]+', '<n>', 'g') = %(fingerprint)s)
ORDER BY d.id

-- name: console_dead_list
-- The dead letters a console selector chooses, one by one (a group opened), oldest first.
SELECT d.id, d.event_id::text, d.topic, d.key, d.attempts, d.error, d.failed_at, d.parked
FROM {schema}.dead_letters AS d
WHERE d.id = ANY(%(ids)s::text::bigint[])
ORDER BY d.id
LIMIT %(limit)s

-- name: console_preview
-- What acting on these dead letters touches: how many, over how many keys, and how many
-- pending events come after a parked one of their key (the parked events that will follow).
SELECT count(*), count(DISTINCT d.key),
       (SELECT count(*) FROM {schema}.events AS e
        WHERE EXISTS (SELECT 1 FROM {schema}.dead_letters AS p
                      WHERE p.id = ANY(%(ids)s::text::bigint[]) AND p.parked
                        AND p.key = e.key AND p.id < e.id))
FROM {schema}.dead_letters AS d
WHERE d.id = ANY(%(ids)s::text::bigint[])

-- name: console_key_pending
-- A key's events not yet delivered, in order: attempts, last error, next try.
SELECT id, event_id::text, topic, attempts, last_error, available_at, created_at, type
FROM {schema}.events WHERE key = %(key)s ORDER BY id LIMIT %(limit)s

-- name: console_key_dead
-- A key's dead letters, in order, with whether each parks the key.
SELECT id, event_id::text, topic, attempts, error, failed_at, parked, created_at, type
FROM {schema}.dead_letters WHERE key = %(key)s ORDER BY id LIMIT %(limit)s

-- name: console_key_delivered
-- A key's latest archived events, newest first, with the sink's coordinates.
SELECT id, event_id::text, topic, attempts, delivered_at, sink_partition, sink_offset, sink_ref,
       created_at, type
FROM {schema}.delivered WHERE key = %(key)s ORDER BY delivered_at DESC, id DESC LIMIT %(limit)s

-- name: console_event
-- One event by event id, wherever it is now: pending, dead, or archived.
SELECT 'pending' AS state, id, event_id::text, topic, key, payload, headers::text, type, subject,
       attempts, created_at, last_error AS error, available_at AS at, NULL::integer, NULL::bigint,
       NULL::text, NULL::boolean
FROM {schema}.events WHERE event_id = %(event_id)s
UNION ALL
SELECT 'dead', id, event_id::text, topic, key, payload, headers::text, type, subject, attempts,
       created_at, error, failed_at, NULL, NULL, NULL, parked
FROM {schema}.dead_letters WHERE event_id = %(event_id)s
UNION ALL
SELECT 'delivered', id, event_id::text, topic, key, payload, headers::text, type, subject, attempts,
       created_at, NULL, delivered_at, sink_partition, sink_offset, sink_ref, NULL
FROM {schema}.delivered WHERE event_id = %(event_id)s
