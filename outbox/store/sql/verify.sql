-- Named statements of `outbox verify` (outbox.verify): the archive's deliveries read back from
-- their sinks, the missing queued again, each verification's summary.

-- name: verify_chunk
-- The next chunk of a window's deliveries, in delivery order: their coordinates, and what the
-- sink should hold there; with a sample of N, one delivery in N (by id). Left out: what a
-- transform filtered (never sent), and deliveries a repair has replaced (their new delivery is
-- checked instead).
SELECT d.id, d.event_id::text, d.topic, d.key, d.payload, d.sink_partition, d.sink_offset, d.sink_ref,
       d.delivered_at
FROM {schema}.delivered AS d
WHERE d.delivered_at >= %(since)s AND d.delivered_at < %(until)s
  AND (%(topics)s::text IS NULL OR d.topic ~ %(topics)s)
  AND d.filtered_by IS NULL
  AND (%(sample)s::int <= 1 OR d.id %% %(sample)s::int = 0)
  AND (d.delivered_at, d.id) > (%(after_at)s::timestamptz, %(after_id)s::bigint)
  AND NOT EXISTS (SELECT FROM {schema}.repaired AS r WHERE r.delivered_id = d.id)
ORDER BY d.delivered_at, d.id
LIMIT %(limit)s

-- name: verify_repair
-- Queue these archived deliveries again (the ones not repaired already), each under its own
-- event id (consumers' inboxes drop a copy that did arrive) and the header outbox-repair (the
-- audit entry's id: a sink's duplicate window must not drop it), in delivery order (per key in
-- order), and mark them repaired. Returns how many were queued.
WITH src AS (
    SELECT d.id, d.event_id, d.topic, d.key, d.payload, d.headers, d.type, d.subject, d.delivered_at
    FROM {schema}.delivered AS d
    WHERE d.id = ANY(%(ids)s::text::bigint[])
      AND NOT EXISTS (SELECT FROM {schema}.repaired AS r WHERE r.delivered_id = d.id)
), marked AS (
    INSERT INTO {schema}.repaired (delivered_id, event_id, audit_id)
    SELECT id, event_id, %(audit)s FROM src
    ON CONFLICT (delivered_id) DO NOTHING
    RETURNING delivered_id
), queued AS (
    INSERT INTO {schema}.events (event_id, topic, key, payload, headers, type, subject)
    SELECT src.event_id, src.topic, src.key, src.payload,
           src.headers || jsonb_build_object('outbox-repair', %(audit)s::text), src.type, src.subject
    FROM src JOIN marked ON marked.delivered_id = src.id
    ORDER BY src.delivered_at, src.id
    RETURNING 1
)
SELECT count(*) FROM queued

-- name: verification_record
-- One verification's summary.
INSERT INTO {schema}.verifications
    (via, since, until, checked, present, missing, expired, unverifiable, missing_ids)
VALUES (%(via)s, %(since)s, %(until)s, %(checked)s, %(present)s, %(missing)s, %(expired)s,
        %(unverifiable)s, %(missing_ids)s::text::uuid[])

-- name: verification_latest
-- The latest verification: when, over which window, what it found.
SELECT at, via, since, until, checked, present, missing, expired, unverifiable, missing_ids::text[]
FROM {schema}.verifications ORDER BY id DESC LIMIT 1

-- name: verify_count
-- How many deliveries a verification of the window checks (its progress).
SELECT count(*) FROM {schema}.delivered AS d
WHERE d.delivered_at >= %(since)s AND d.delivered_at < %(until)s
  AND (%(topics)s::text IS NULL OR d.topic ~ %(topics)s)
  AND d.filtered_by IS NULL
  AND NOT EXISTS (SELECT FROM {schema}.repaired AS r WHERE r.delivered_id = d.id)
