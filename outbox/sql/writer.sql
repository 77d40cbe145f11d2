-- Named queries of the write side (outbox.writer).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: insert_event
-- One event, written by the application inside its own transaction.
INSERT INTO {schema}.events (event_id, topic, key, payload, headers, available_at)
VALUES (%s, %s, %s, %s, %s, now() + %s * interval '1 second')

-- name: copy_events
-- Many events without delay, streamed with COPY (binary).
COPY {schema}.events (event_id, topic, key, payload, headers) FROM STDIN (FORMAT BINARY)

-- name: events_table
-- The events table of a schema, or NULL when the schema has not been migrated.
SELECT to_regclass(format('%%I.events', %s::text)) IS NOT NULL

-- name: notify_trigger
-- Switch the NOTIFY-on-insert trigger on or off (`outbox notify on|off`).
ALTER TABLE {schema}.events {state} TRIGGER events_notify

-- name: listen_events
-- Wake-ups: LISTEN on the schema's channel (bound as an identifier by the caller).
LISTEN {channel}
