-- Named queries of the audit trail (outbox.audit): operators' redrives, skips, replays, purges.
-- {schema} is the schema as an identifier (psycopg.sql); every value is a bound parameter.

-- name: audit_begin
-- One action: who, through what, the selector and how many it will act on; its id. Through
-- audit_begin (migration 0017), which records the database role and the time itself.
SELECT {schema}.audit_begin(%(actor)s, %(via)s, %(action)s, %(selector)s::jsonb, %(planned)s)

-- name: audit_done
-- How many the action did, once it has done them (audit_done: once, by the role that began it).
SELECT {schema}.audit_done(%(id)s, %(done)s)

-- name: audit_list
-- The latest actions, newest first.
SELECT id, at, actor, db_user, via, action, selector::text, planned, done, finished_at
FROM {schema}.audit
ORDER BY id DESC
LIMIT %(limit)s
