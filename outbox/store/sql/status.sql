-- Named queries of `outbox status` and the metrics gauges.
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: status_counts
-- Depth, retrying, dead (and of them expired: migration 0023) and delivered counts, and the age
-- of the oldest pending event.
SELECT
    (SELECT count(*) FROM {schema}.events) AS pending,
    (SELECT count(*) FROM {schema}.events WHERE attempts > 0) AS retrying,
    (SELECT count(*) FROM {schema}.dead_letters) AS dead,
    (SELECT count(*) FROM {schema}.dead_letters WHERE kind = 'expired') AS expired,
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
-- Events archived in the last hour, and how many of them a transform dropped (migration 0022).
SELECT count(*), count(filtered_by) FROM {schema}.delivered WHERE delivered_at > now() - interval '1 hour'

-- name: status_parked_keys
-- Keys held back by a parked dead letter, with how many events wait behind it.
SELECT d.key, d.topic, d.id, d.error,
       (SELECT count(*) FROM {schema}.events AS e WHERE e.key = d.key AND e.id > d.id) AS waiting
FROM {schema}.dead_letters AS d
WHERE d.parked
ORDER BY d.id
LIMIT 50

-- name: status_owners
-- Which relay owns which partitions now: the outbox's relays whose membership in the database
-- (outbox_fleet.relays, migration 0018) is live; its heartbeat and readiness are the membership's.
SELECT r.id::text, r.name, r.ordering, f.heartbeat_at,
       coalesce(array_agg(p.partition ORDER BY p.partition)
                FILTER (WHERE p.partition IS NOT NULL), '{{}}') AS partitions,
       f.readiness
FROM {schema}.relays AS r
JOIN outbox_fleet.relays AS f ON f.id = r.id AND f.expires_at > now()
LEFT JOIN {schema}.partitions AS p ON p.owner = r.id
GROUP BY r.id, r.name, r.ordering, f.heartbeat_at, f.readiness
ORDER BY r.started_at, r.id

-- name: status_unowned
-- Partitions no live relay owns.
SELECT count(*) FROM {schema}.partitions AS p
WHERE NOT EXISTS (SELECT 1 FROM outbox_fleet.relays AS f WHERE f.id = p.owner AND f.expires_at > now())

-- name: hot_table_stats
-- Dead and live tuples (statistics) and size of the hot events table.
-- The statistics functions on the table's oid, not the pg_stat_user_tables view: the view groups
-- every table of the database before it filters (16 ms a call at 1,000 schemas).
SELECT pg_stat_get_dead_tuples(t.oid), pg_stat_get_live_tuples(t.oid), pg_total_relation_size(t.oid)
FROM (SELECT format('%%I.events', %(schema)s::text)::regclass::oid AS oid) AS t

-- name: oldest_xmin_age
-- Seconds since the oldest transaction that holds back vacuum started (NULL if none).
SELECT extract(epoch FROM now() - min(xact_start))::float8
FROM pg_stat_activity
WHERE backend_xmin IS NOT NULL AND pid <> pg_backend_pid() AND datname = current_database()

-- name: metrics_session
-- The metrics reader's statement timeout, as a statement (PgBouncer refuses `options`).
SELECT set_config('statement_timeout', '3000', false)

-- name: status_summary
-- One outbox in one line (`outbox status --all`): depth, retrying, dead letters, parked keys,
-- the oldest pending age, the last hour's deliveries (BRIN on delivered_at), live relays and
-- unowned partitions. The archive is not counted: at millions of rows that is seconds per outbox.
SELECT
    (SELECT count(*) FROM {schema}.events),
    (SELECT count(*) FROM {schema}.events WHERE attempts > 0),
    (SELECT count(*) FROM {schema}.dead_letters),
    (SELECT count(*) FROM {schema}.dead_letters WHERE parked),
    (SELECT extract(epoch FROM clock_timestamp() - created_at)::float8
       FROM {schema}.events ORDER BY id LIMIT 1),
    (SELECT count(*) FROM {schema}.delivered WHERE delivered_at > now() - interval '1 hour'),
    (SELECT count(*) FROM {schema}.relays AS r
      JOIN outbox_fleet.relays AS f ON f.id = r.id AND f.expires_at > now()),
    (SELECT count(*) FROM {schema}.partitions AS p
      WHERE NOT EXISTS (SELECT 1 FROM outbox_fleet.relays AS f
                        WHERE f.id = p.owner AND f.expires_at > now()))

-- name: status_limits
-- The limits (--limit) the relays of this outbox last gave (outbox_fleet.limits), each with the
-- events waiting of the topics it matches, and the events its live relays have in flight.
SELECT l.glob, l.spec,
       (SELECT coalesce(sum(t.n), 0)
          FROM (SELECT topic, count(*) AS n FROM {schema}.events GROUP BY topic) AS t
         WHERE t.topic ~ l.pattern) AS waiting,
       (SELECT coalesce(sum(u.in_flight), 0)
          FROM outbox_fleet.limit_flights AS u
          JOIN outbox_fleet.relays AS f ON f.id = u.relay AND f.expires_at > now()
         WHERE u.outbox = l.outbox AND u.glob = l.glob) AS in_flight,
       extract(epoch FROM now() - l.at)::float8 AS since
FROM outbox_fleet.limits AS l
WHERE l.outbox = %(schema)s
ORDER BY l.glob
