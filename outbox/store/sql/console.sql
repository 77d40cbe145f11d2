-- Named queries of the operator console (outbox.console).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is the schema as an
-- identifier (psycopg.sql); every value is a bound parameter. Literal braces are doubled.

-- name: console_estimate
-- The planner's estimate of a table's rows (EXPLAIN scales the rows per page of the last
-- ANALYZE to the table's pages now): shown where an exact count would scan a big table.
EXPLAIN (FORMAT JSON) SELECT 1 FROM {schema}.{table}

-- name: console_events_by_topic
-- Events per topic: first attempt due (pending) and retrying, and the oldest one's age.
SELECT topic, count(*) FILTER (WHERE attempts = 0), count(*) FILTER (WHERE attempts > 0),
       extract(epoch FROM clock_timestamp() - min(created_at))::float8
FROM {schema}.events
GROUP BY topic

-- name: console_events_by_topic_sampled
-- The same counts from a sample of the table's pages (the same pages while the table is
-- unchanged), not yet scaled to the table; no age: a sample's oldest is not the oldest.
SELECT topic, count(*) FILTER (WHERE attempts = 0), count(*) FILTER (WHERE attempts > 0)
FROM {schema}.events TABLESAMPLE SYSTEM (%(percent)s) REPEATABLE (0)
GROUP BY topic

-- name: console_oldest_by_topic
-- The oldest pending event's age for each topic given: its first row in id order (the
-- primary key's order, so a topic with a share of the backlog is found after few rows).
SELECT t.topic, extract(epoch FROM clock_timestamp() - o.created_at)::float8
FROM unnest(%(topics)s::text[]) AS t(topic)
CROSS JOIN LATERAL (SELECT e.created_at FROM {schema}.events AS e WHERE e.topic = t.topic
                    ORDER BY e.id LIMIT 1) AS o

-- name: console_oldest_pending
-- The oldest pending event's age (the first in id order), NULL when nothing is pending.
SELECT extract(epoch FROM clock_timestamp() - created_at)::float8
FROM {schema}.events ORDER BY id LIMIT 1

-- name: console_dead_by_topic
-- Dead letters per topic, and the keys they park.
SELECT topic, count(*), count(DISTINCT key) FILTER (WHERE parked)
FROM {schema}.dead_letters
GROUP BY topic

-- name: console_parked_keys
-- Keys parked behind a dead letter, in all.
SELECT count(DISTINCT key) FROM {schema}.dead_letters WHERE parked

-- name: console_delivered_last_hour
-- Events archived in the last hour per topic (the archive's BRIN index on delivered_at, 0011).
SELECT topic, count(*)
FROM {schema}.delivered
WHERE delivered_at > now() - interval '1 hour'
GROUP BY topic

-- name: console_archived
-- Events in the archive (exactly: only asked while the estimate is small).
SELECT count(*) FROM {schema}.delivered

-- name: console_delivered_per_minute
-- Events archived per topic and minute over the last hour (the overview's chart).
SELECT topic, extract(epoch FROM date_trunc('minute', delivered_at))::bigint AS minute, count(*)
FROM {schema}.delivered
WHERE delivered_at > date_trunc('minute', now()) - interval '59 minutes'
GROUP BY 1, 2
ORDER BY 1, 2

-- name: console_dead_groups
-- Dead letters grouped by topic and error fingerprint (the error with ids and numbers masked:
-- a column, migration 0011), filtered; each group's count, first and last failure, keys it
-- parks and its highest seq. The kind: as the relay kept it (migration 0020), else the error's
-- first word.
WITH chosen AS (
    SELECT d.*
    FROM {schema}.dead_letters AS d
    WHERE d.seq <= %(high_water)s
      AND (%(topic)s::text IS NULL OR d.topic = %(topic)s)
      AND (%(key)s::bytea IS NULL OR d.key = %(key)s)
      AND (%(error)s::text IS NULL OR strpos(lower(d.error), lower(%(error)s)) > 0)
      AND (%(since)s::timestamptz IS NULL OR d.failed_at >= %(since)s)
      AND (%(until)s::timestamptz IS NULL OR d.failed_at < %(until)s)
)
SELECT topic, fingerprint, coalesce(min(kind), split_part(fingerprint, ':', 1)) AS kind, count(*), min(failed_at),
       max(failed_at), count(DISTINCT key) FILTER (WHERE parked), max(seq),
       (array_agg(key ORDER BY id) FILTER (WHERE parked))[1:5]
FROM chosen
GROUP BY topic, fingerprint
ORDER BY count(*) DESC, topic, fingerprint
LIMIT 200

-- name: console_dead_high_water
-- The last dead letter made so far (its seq, migration 0016): what a page shows and what its
-- actions may touch.
SELECT coalesce(max(seq), 0) FROM {schema}.dead_letters

-- name: console_dead_list
-- The dead letters a console selector chooses, one by one (a group opened), oldest first.
SELECT d.id, d.event_id::text, d.topic, d.key, d.attempts, d.error, d.failed_at, d.parked, d.kind
FROM {schema}.dead_letters AS d
WHERE d.id = ANY(%(ids)s::text::bigint[])
ORDER BY d.id
LIMIT %(limit)s

-- name: console_preview
-- What acting on these dead letters touches: how many, over how many keys, and how many
-- pending events come after a parked one of their key (the parked events that will follow):
-- for each chosen key's first parked dead letter, its later events through events (key, id).
WITH chosen AS (
    SELECT id, key, parked FROM {schema}.dead_letters WHERE id = ANY(%(ids)s::text::bigint[])
), parking AS (
    SELECT key, min(id) AS id FROM chosen WHERE parked AND key IS NOT NULL GROUP BY key
)
SELECT (SELECT count(*) FROM chosen), (SELECT count(DISTINCT key) FROM chosen),
       (SELECT count(*) FROM {schema}.events AS e JOIN parking AS p ON p.key = e.key AND e.id > p.id)

-- name: console_key_pending
-- A key's events not yet delivered, in order: attempts, last error, next try (events (key, id)).
SELECT id, event_id::text, topic, attempts, last_error, available_at, created_at, type
FROM {schema}.events WHERE key = %(key)s ORDER BY id LIMIT %(limit)s

-- name: console_key_dead
-- A key's dead letters, in order, with whether each parks the key.
SELECT id, event_id::text, topic, attempts, error, failed_at, parked, created_at, type
FROM {schema}.dead_letters WHERE key = %(key)s ORDER BY id LIMIT %(limit)s

-- name: console_key_delivered
-- A key's latest archived events, newest first, with the sink's coordinates (the index on
-- (key, delivered_at), 0011, read backwards in each day partition, merged).
SELECT id, event_id::text, topic, attempts, delivered_at, sink_partition, sink_offset, sink_ref,
       created_at, type
FROM {schema}.delivered WHERE key = %(key)s ORDER BY delivered_at DESC LIMIT %(limit)s

-- name: console_event
-- One event by event id where it is waiting: pending or dead (a small table, indexed by
-- event id, 0011).
SELECT 'pending' AS state, id, event_id::text, topic, key, payload, headers::text, type, subject,
       attempts, created_at, last_error AS error, available_at AS at, NULL::integer, NULL::bigint,
       NULL::text, NULL::boolean, NULL::text
FROM {schema}.events WHERE event_id = %(event_id)s
UNION ALL
SELECT 'dead', id, event_id::text, topic, key, payload, headers::text, type, subject, attempts,
       created_at, error, failed_at, NULL, NULL, NULL, parked, kind
FROM {schema}.dead_letters WHERE event_id = %(event_id)s

-- name: console_event_archived
-- One event's archived rows (a replayed one has several): by its key through the archive's
-- (key, delivered_at) index, or, with no key given, by scanning the archive.
SELECT 'delivered', id, event_id::text, topic, key, payload, headers::text, type, subject, attempts,
       created_at, NULL, delivered_at, sink_partition, sink_offset, sink_ref, NULL, NULL
FROM {schema}.delivered
WHERE event_id = %(event_id)s AND (%(key)s::bytea IS NULL OR key = %(key)s)

-- name: fleet_outbox_row
-- One outbox's row of the console's fleet page: pending (counted up to 100,000: a big backlog
-- costs no more to show), the oldest pending age, retrying, dead letters, parked keys, and the
-- live relays serving it (their membership in outbox_fleet.relays).
SELECT (SELECT count(*) FROM (SELECT 1 FROM {schema}.events LIMIT 100000) AS capped),
       (SELECT extract(epoch FROM clock_timestamp() - created_at)::float8
          FROM {schema}.events ORDER BY id LIMIT 1),
       (SELECT count(*) FROM {schema}.events WHERE attempts > 0),
       (SELECT count(*) FROM {schema}.dead_letters),
       (SELECT count(*) FROM {schema}.dead_letters WHERE parked),
       (SELECT count(*) FROM {schema}.relays AS r
          JOIN outbox_fleet.relays AS f ON f.id = r.id AND f.expires_at > now())

-- name: fleet_limits
-- Every limit (--limit) the relays of this database's outboxes gave, with their events in flight.
SELECT l.outbox, l.glob, l.spec,
       (SELECT coalesce(sum(u.in_flight), 0)
          FROM outbox_fleet.limit_flights AS u
          JOIN outbox_fleet.relays AS f ON f.id = u.relay AND f.expires_at > now()
         WHERE u.outbox = l.outbox AND u.glob = l.glob)
FROM outbox_fleet.limits AS l
ORDER BY l.outbox, l.glob
