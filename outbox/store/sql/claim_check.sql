-- Named queries of the claim-check store in PostgreSQL (outbox.claim_check). Same rules as
-- relay.sql: {schema} is an identifier, values are parameters. A consumer's fetch runs them on a
-- session the project does not pin: pg_catalog's functions by their full names, operators on
-- their exact types (queries.APPLICATION_SESSION).

-- name: claim_check_put
-- Store a payload under its event id (again on a retry: the same key, the latest bytes).
INSERT INTO {schema}.claim_checks (event_id, payload) VALUES (%s, %s)
ON CONFLICT (event_id) DO UPDATE SET payload = excluded.payload, stored_at = pg_catalog.now()

-- name: claim_check_get
-- A stored payload by its event id.
SELECT payload FROM {schema}.claim_checks WHERE event_id = %s::uuid

-- name: claim_check_purge_chunk
-- Delete up to %(limit)s payloads stored before %(cutoff)s.
DELETE FROM {schema}.claim_checks
WHERE event_id = ANY(ARRAY(SELECT event_id FROM {schema}.claim_checks
                           WHERE stored_at < %(cutoff)s::timestamptz LIMIT %(limit)s::bigint))

-- name: claim_check_held
-- Payloads held and their bytes (NULL, NULL when the table does not exist).
SELECT pg_catalog.count(*), coalesce(pg_catalog.sum(pg_catalog.octet_length(payload)), 0)
FROM {schema}.claim_checks

-- name: claim_check_table
-- Whether the schema has the claim-check table.
SELECT pg_catalog.to_regclass(pg_catalog.format('%%I.claim_checks', %s::text)) IS NOT NULL
