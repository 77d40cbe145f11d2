-- Named queries of WAL capture (outbox.capture; migration 0013).
-- Each block starts with `-- name: <name>` and a one-line comment. {schema} is
-- the schema as an identifier (psycopg.sql), never string formatting; every
-- value is a bound parameter. Literal braces are doubled.

-- name: capture_state
-- The outbox's capture mode, its slot and publication, and the position handed on so far: the
-- greatest in capture_positions (migration 0014; the last entry of its index), or capture's own
-- columns if greater (where a relay before 0014 kept it: a rolling upgrade hands it on).
SELECT c.mode, c.slot, c.publication, p.lsn::text, p.part_commit::text, coalesce(p.part_events, 0)
FROM {schema}.capture AS c
LEFT JOIN LATERAL (
    SELECT lsn, part_commit, part_events FROM (
        (SELECT lsn, part_commit, part_events FROM {schema}.capture_positions
         ORDER BY coalesce(part_commit, lsn, '0/0'::pg_lsn) DESC,
                  CASE WHEN part_commit IS NULL THEN 0 ELSE part_events END DESC
         LIMIT 1)
        UNION ALL
        SELECT c.lsn, c.part_commit, c.part_events WHERE c.lsn IS NOT NULL OR c.part_commit IS NOT NULL
    ) AS both_kept
    ORDER BY coalesce(part_commit, lsn, '0/0'::pg_lsn) DESC,
             CASE WHEN part_commit IS NULL THEN 0 ELSE part_events END DESC
    LIMIT 1
) AS p ON true

-- name: capture_table_exists
-- Whether the schema has migration 0013 (the capture table), for writers and relays that
-- may meet an outbox migrated by an older release.
SELECT to_regclass(format('%%I.capture', %(schema)s::text)) IS NOT NULL

-- name: writer_capture
-- For a writer, once per connection: the capture mode of an outbox ('table' before migration
-- 0013), NULL when the schema holds no outbox.
SELECT CASE WHEN pg_catalog.to_regclass(pg_catalog.format('%%I.events', %s::text)) IS NULL THEN NULL
            WHEN pg_catalog.to_regclass(pg_catalog.format('%%I.capture', %s::text)) IS NULL THEN 'table'
            ELSE 'check' END

-- name: writer_capture_numbered
-- writer_capture with numbered parameters (asyncpg).
SELECT CASE WHEN pg_catalog.to_regclass(pg_catalog.format('%I.events', $1::text)) IS NULL THEN NULL
            WHEN pg_catalog.to_regclass(pg_catalog.format('%I.capture', $1::text)) IS NULL THEN 'table'
            ELSE 'check' END

-- name: capture_mode
-- The capture mode (after writer_capture found the table).
SELECT mode FROM {schema}.capture

-- name: set_capture
-- Switch the capture mode (outbox migrate --capture); the slot and publication are kept.
UPDATE {schema}.capture
SET mode = %(mode)s, slot = %(slot)s, publication = %(publication)s, switched_at = now()

-- name: wal_level
-- The server's wal_level and major version (WAL capture needs logical, and PostgreSQL 14+), and
-- the database's name (a slot's is made from it: slots are the server's).
SELECT current_setting('wal_level'), current_setting('server_version_num')::integer, current_database()

-- name: enable_logical_wal
-- The embedded PostgreSQL of the demo and the bench: wal_level = logical (after a restart).
ALTER SYSTEM SET wal_level = logical

-- name: slot_of
-- A replication slot: its plugin, database, whether a session reads it, and how far it is confirmed.
SELECT plugin, database, active, confirmed_flush_lsn::text
FROM pg_replication_slots WHERE slot_name = %(slot)s

-- name: create_slot
-- A logical replication slot decoded by pgoutput (built in; its `messages` option needs 14+).
SELECT lsn::text FROM pg_create_logical_replication_slot(%(slot)s, 'pgoutput')

-- name: create_slot_failover
-- create_slot on PostgreSQL 17+: a failover slot, synchronised to standbys that are set up
-- for it (sync_replication_slots), so it exists on a promoted replica.
SELECT lsn::text FROM pg_create_logical_replication_slot(%(slot)s, 'pgoutput', false, false, true)

-- name: drop_slot
-- Drop the outbox's slot (outbox migrate --capture table --drop-slot).
SELECT pg_drop_replication_slot(%(slot)s)

-- name: publication_exists
-- Whether the publication pgoutput is started with exists.
SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = %(publication)s)

-- name: create_publication
-- An empty publication: pgoutput needs one to start, and the outbox publishes no table
-- (its events are logical decoding messages, which pgoutput sends with `messages`).
CREATE PUBLICATION {publication}

-- name: drop_publication
-- The outbox's publication, when its schema goes (the bench's workspaces).
DROP PUBLICATION IF EXISTS {publication}

-- name: emit_events
-- WAL capture's write: emit_events() (migration 0015) emits one transactional logical decoding
-- message per event, in order, under the outbox's prefix, signed; each is the event's encoding
-- (outbox.wal_message.encode). Nothing is written to a table.
SELECT {schema}.emit_events(%s::bytea[])

-- name: emit_events_binary
-- emit_events for psycopg 3: the messages as one binary array (%b). In text, psycopg escapes
-- each element in Python: enqueue_many(1,000) took 18 ms against COPY's 12 in table capture.
SELECT {schema}.emit_events(%b::bytea[])

-- name: emit_events_numbered
-- emit_events with numbered parameters (asyncpg), the messages as hex text[].
SELECT {schema}.emit_events(ARRAY(SELECT pg_catalog.decode(m, 'hex')
                                  FROM pg_catalog.unnest($1::text[]) WITH ORDINALITY AS x (m, n)
                                  ORDER BY n))

-- name: capture_key
-- The key the outbox's WAL messages are signed with (migration 0015): read by the relay's reader.
SELECT key FROM {schema}.capture_key

-- name: capture_keys
-- The keys a message may be signed with (migration 0021), newest first, each with the time
-- (epoch) from which what commits no longer verifies with it (NULL: the current key).
SELECT key, extract(epoch FROM retire_at)::float8 FROM {schema}.capture_keys ORDER BY id DESC

-- name: capture_key_add
-- `outbox capture rotate-key`: a new key, 32 bytes from PostgreSQL's strong random source, and
-- HMAC's pads beside it (as migration 0015 made the first); its id, and the key it replaces.
INSERT INTO {schema}.capture_keys (key, ipad, opad)
SELECT k,
       (SELECT string_agg(set_byte('\x00'::bytea, 0, get_byte(p, i) # 54), '' ORDER BY i)
        FROM generate_series(0, 63) AS i),
       (SELECT string_agg(set_byte('\x00'::bytea, 0, get_byte(p, i) # 92), '' ORDER BY i)
        FROM generate_series(0, 63) AS i)
FROM (SELECT k, k || '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea AS p
      FROM (SELECT uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()) AS k) AS random_key
     ) AS key_and_block
RETURNING id, (SELECT max(id) FROM {schema}.capture_keys)

-- name: capture_key_rotated
-- The rotation's message, in its transaction, under the outbox's prefix, signed with the key it
-- retires (the reader knows that one): in WAL order it comes before anything the new key signs,
-- and tells the reader to read the keys again. Its content: "rotate", a line break, the new id.
SELECT pg_logical_emit_message(true, 'outbox:' || {schema_name},
                               sha256(opad || sha256(ipad || c)) || c)::text
FROM {schema}.capture_keys,
     (SELECT convert_to('rotate' || chr(10) || %(new)s::text, 'UTF8') AS c) AS marker
WHERE id = %(old)s

-- name: capture_key_retire
-- The keys before the new one verify what commits within the window, then nothing more. The
-- window runs from the rotation's last statement (clock_timestamp, not the transaction's start).
UPDATE {schema}.capture_keys
SET retire_at = clock_timestamp() + %(window)s * interval '1 second', retired_lsn = pg_current_wal_lsn()
WHERE id < %(new)s AND retire_at IS NULL
RETURNING id, retire_at

-- name: capture_key_current
-- capture_key keeps the newest key too, for a relay of an earlier version (it reads that one).
UPDATE {schema}.capture_key AS c SET key = n.key, ipad = n.ipad, opad = n.opad
FROM {schema}.capture_keys AS n WHERE n.id = %(new)s

-- name: capture_keys_passed
-- Retired keys whose window ended (a second ago: a commit's time is taken just before its record
-- is written) get the WAL's end now: nothing they verify commits past it (migration 0026). The
-- insert position: a commit not yet written out (synchronous_commit off) is before it too.
UPDATE {schema}.capture_keys SET passed_lsn = pg_current_wal_insert_lsn()
WHERE retire_at < clock_timestamp() - %(margin)s * interval '1 second' AND passed_lsn IS NULL

-- name: capture_keys_drop
-- Retired keys once the outbox's slot is confirmed past every message they could have signed
-- (passed_lsn): nothing in the WAL can need them. Returns their ids.
DELETE FROM {schema}.capture_keys
WHERE passed_lsn <= coalesce((SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = %(slot)s),
                             pg_current_wal_lsn())
RETURNING id

-- name: wal_table_quiet
-- Before wal_keys_waiting: is there anything at all in the table that a WAL event of a key must
-- not overtake (a pending event with a key, a parked dead letter)? Nearly always not: then the
-- batch's keys are not sent (a thousand keys cost 1.7 ms a batch to dump, send and plan, against
-- one probe of each partial index here).
-- (Scalar subqueries ordered by the partial indexes' columns: a probe of each, never a scan of
-- keyless rows, statistics or not. EXISTS drops the ORDER BY and LIMIT, and without statistics
-- scanned 100,000 keyless rows for 15 ms.)
SELECT (SELECT id FROM {schema}.events WHERE key IS NOT NULL ORDER BY key, id LIMIT 1) IS NULL
   AND (SELECT id FROM {schema}.dead_letters WHERE parked ORDER BY key, id LIMIT 1) IS NULL

-- name: wal_keys_waiting
-- Of these keys, those that have something waiting in the table that a WAL event of the key must
-- not overtake, and since when: the creation time (epoch) of the key's oldest pending event
-- (retrying, held, delayed, or written in table capture), or 0 for a parked dead letter (it holds
-- every later event). A WAL event created before the key's oldest pending row may go first (rows
-- written after switching back to table capture). The keys go in binary (%b): in text psycopg
-- escapes each one in Python.
SELECT key, min(since) FROM (
    SELECT key, extract(epoch FROM min(created_at))::float8 AS since
    FROM {schema}.events WHERE key = ANY(%(keys)b::bytea[]) GROUP BY key
    UNION ALL
    SELECT key, 0 FROM {schema}.dead_letters WHERE parked AND key = ANY(%(keys)b::bytea[])
) AS w
GROUP BY key

-- name: wal_to_events
-- (The arrays go in binary, %b: psycopg's text format escapes every element in Python, which
-- was 45 % of the relay's time per WAL event. Two go as one array literal each, joined in C:
-- the ids, UUIDs the reader checked, and the creation times, floats. A column that is NULL for
-- every event goes as an empty array, which unnest pads with NULLs.)
-- Events read from the WAL that were not delivered (a failure, a dead letter, or held behind
-- their key) go into the events table in commit order, where the table's machinery retries,
-- dead-letters and parks them. Returns each one's new id.
INSERT INTO {schema}.events (event_id, topic, key, payload, headers, type, subject, created_at, expires_at)
SELECT e, t, k, p, coalesce(h, '{{}}'::jsonb), ty, su, to_timestamp(c), to_timestamp(ex)
FROM unnest(%(event_ids)s::text::uuid[], %(topics)b::text[], %(keys)b::bytea[], %(payloads)b::bytea[],
            %(headers)b::jsonb[], %(types)b::text[], %(subjects)b::text[], %(created)s::text::float8[],
            %(expires)b::float8[])
    WITH ORDINALITY AS x (e, t, k, p, h, ty, su, c, ex, n)
ORDER BY n
RETURNING id, event_id::text

-- name: wal_archive
-- Events read from the WAL and acked by their sink, archived with the sink's coordinates; their
-- ids come from the events table's sequence, as a table event's would. The sequence is looked up
-- once (an uncorrelated subquery): looked up per row it cost 4 us an event, a tenth of the
-- server's time per WAL event.
INSERT INTO {schema}.delivered
    (id, event_id, topic, key, payload, headers, created_at, attempts,
     sink_partition, sink_offset, sink_ref, type, subject, filtered_by)
SELECT nextval((SELECT pg_get_serial_sequence(format('%%I.events', %(schema)s::text), 'id')::regclass)),
       e, t, k, p, coalesce(h, '{{}}'::jsonb), to_timestamp(c), 1, sp, so, sr, ty, su, fb
FROM unnest(%(event_ids)s::text::uuid[], %(topics)b::text[], %(keys)b::bytea[], %(payloads)b::bytea[],
            %(headers)b::jsonb[], %(types)b::text[], %(subjects)b::text[], %(created)s::text::float8[],
            %(partitions)s::text::integer[], %(offsets)s::text::bigint[], %(refs)s::text[],
            %(filtered)s::text[])
    AS x (e, t, k, p, h, ty, su, c, sp, so, sr, fb)

-- name: wal_handed_on
-- The WAL is handed on up to this position (committed with what it handed on): the transactions
-- ending at or before lsn, and the first part_events of the one committed at part_commit (NULL:
-- none). Appended (migration 0014: an update per batch left a dead row version that a held
-- snapshot keeps, and every later update read them all); the greatest position counts.
INSERT INTO {schema}.capture_positions (lsn, part_commit, part_events)
VALUES (%(lsn)s::pg_lsn, %(part_commit)s::pg_lsn, %(part_events)s)

-- name: wal_positions_superseded
-- Before wal_handed_on, in its transaction: the positions it supersedes among the last 16 rows
-- (by id; the newest is found through the primary key's last entry), so that one or two rows
-- stay live and nothing reads the dead ones a held snapshot keeps. A lower position of a reader
-- that lost the slot is deleted by the next batch; a higher one is never deleted here.
-- The position is compared as coalesce(part_commit, lsn) (lsn is never NULL here), not as the
-- position index's expression: matched, the planner took that index whenever the statistics
-- said the table was small (after any ANALYZE), and walked every dead entry below the new
-- position (108 buffers after 10,000 batches under a held snapshot, against 7 through the key).
DELETE FROM {schema}.capture_positions
WHERE id > (SELECT max(id) FROM {schema}.capture_positions) - 16
  AND (coalesce(part_commit, lsn), CASE WHEN part_commit IS NULL THEN 0 ELSE part_events END)
      <= (coalesce(%(part_commit)s::pg_lsn, %(lsn)s::pg_lsn), %(part_events)s)

-- name: current_wal_lsn
-- Where the WAL ends now: a reader that has been sent everything up to here has caught up.
SELECT pg_current_wal_lsn()::text

-- name: slot_lag
-- The slot's health: read by a session, and the WAL it keeps that is not confirmed yet (bytes).
SELECT active, pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint, confirmed_flush_lsn::text
FROM pg_replication_slots WHERE slot_name = %(slot)s

-- name: database_slots
-- The database's name (an outbox's slot is named from it), the names of its replication slots and
-- of its publications. An outbox with neither its slot nor its publication needs no reader; one
-- with only its publication lost its slot (a failover to a standby that did not synchronise it:
-- the publication is in the catalog the standby copied) and must be read, to say so.
SELECT current_database(),
       ARRAY(SELECT slot_name::text FROM pg_replication_slots WHERE database = current_database()),
       ARRAY(SELECT pubname::text FROM pg_publication)

-- name: identify_system
-- On a replication connection (a command of the replication protocol, not SQL): the server's
-- system identifier, timeline, WAL position and database. A new timeline is a promoted standby.
IDENTIFY_SYSTEM
