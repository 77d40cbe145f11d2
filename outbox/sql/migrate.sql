-- Named statements of `outbox migrate` (outbox.migrate). The numbered migrations
-- themselves are the files in migrations/. {schema} is an identifier; values that
-- must appear in `migrate --print` output are bound as literals by the caller.

-- name: migrate_lock
-- Serialise migrations of one schema (relays starting side by side).
SELECT pg_advisory_xact_lock(%s)

-- name: migrate_preamble
-- The schema and the table that records applied migrations.
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

-- name: migrate_record
-- Record one applied migration (values bound as literals: it is printed too).
INSERT INTO {schema}.schema_migrations (version, name, checksum) VALUES ({version}, {name}, {checksum})

-- name: migrations_table
-- The schema_migrations table of a schema, or NULL when it was never migrated.
SELECT to_regclass(format('%%I.schema_migrations', %s::text))

-- name: migrations_applied
-- Versions and checksums already applied to a schema.
SELECT version, checksum FROM {schema}.schema_migrations

-- name: role_exists
-- Whether a role exists (`migrate --no-create-roles` grants only to existing roles).
SELECT 1 FROM pg_roles WHERE rolname = %s

-- name: do_block
-- Run a PL/pgSQL block; its body (one of the *_body statements) is bound as a string
-- literal, so no name inside it can end the block early.
DO {body}

-- name: create_role_body
-- Create a NOLOGIN role unless it exists (a do_block body; the role is an identifier).
BEGIN CREATE ROLE {role} NOLOGIN; EXCEPTION WHEN duplicate_object THEN NULL; END

-- name: grant_maintain
-- PostgreSQL 17+: MAINTAIN lets the relay VACUUM its hot table without owning it.
GRANT MAINTAIN ON {schema}.events TO {relay}

-- name: if_server_17_body
-- Run a statement (bound as a string literal) only on PostgreSQL 17 or newer (a do_block body).
BEGIN IF current_setting('server_version_num')::int >= 170000 THEN EXECUTE {statement}; END IF; END

-- name: outbox_schemas
-- Schemas that hold outbox tables (a schema_migrations table; migrated or not), by name:
-- `--schemas GLOB` matches among them.
SELECT n.nspname FROM pg_namespace AS n
JOIN pg_class AS c ON c.relnamespace = n.oid AND c.relname = 'schema_migrations' AND c.relkind = 'r'
ORDER BY n.nspname

-- name: user_schemas
-- Every schema but PostgreSQL's own: `migrate --schemas GLOB` matches among them.
SELECT nspname FROM pg_namespace
WHERE nspname !~ '^pg_' AND nspname <> 'information_schema'
ORDER BY nspname
