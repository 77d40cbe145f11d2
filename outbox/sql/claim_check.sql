-- Named queries of the claim-check store in PostgreSQL (outbox.claim_check). Same rules as
-- relay.sql: {schema} is an identifier, values are parameters.

-- name: claim_check_put
-- Store a payload under its event id (again on a retry: the same key, the latest bytes).
INSERT INTO {schema}.claim_checks (event_id, payload) VALUES (%s, %s)
ON CONFLICT (event_id) DO UPDATE SET payload = excluded.payload, stored_at = now()

-- name: claim_check_get
-- A stored payload by its event id.
SELECT payload FROM {schema}.claim_checks WHERE event_id = %s

-- name: claim_check_purge_chunk
-- Delete up to %(limit)s payloads stored before %(cutoff)s.
DELETE FROM {schema}.claim_checks
WHERE event_id = ANY(ARRAY(SELECT event_id FROM {schema}.claim_checks
                           WHERE stored_at < %(cutoff)s LIMIT %(limit)s))

-- name: claim_check_held
-- Payloads held and their bytes (NULL, NULL when the table does not exist).
SELECT count(*), coalesce(sum(octet_length(payload)), 0) FROM {schema}.claim_checks

-- name: claim_check_table
-- Whether the schema has the claim-check table.
SELECT to_regclass(format('%%I.claim_checks', %s::text)) IS NOT NULL
