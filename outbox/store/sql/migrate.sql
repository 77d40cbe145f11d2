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

-- name: revoke_key_readers_body
-- WAL capture's signing keys (capture_key, capture_keys) are readable by their owner and the
-- relay role alone: every other grantee's privileges on them go, table and columns (REVOKE ALL on
-- a table revokes its column grants too). A reporting role given SELECT on the schema's future
-- tables by ALTER DEFAULT PRIVILEGES read the key and signed events the relay delivered (issue 70).
-- A do_block body: {relay_name} is the relay role as a literal.
DECLARE
    g record;
BEGIN
    FOR g IN
        SELECT DISTINCT c.oid::regclass::text AS tab, a.grantee
        FROM pg_catalog.pg_class AS c
        CROSS JOIN LATERAL pg_catalog.aclexplode(c.relacl) AS a
        WHERE c.oid IN (pg_catalog.to_regclass(pg_catalog.format('%I.capture_key', {schema_name}::text)),
                        pg_catalog.to_regclass(pg_catalog.format('%I.capture_keys', {schema_name}::text)))
          AND a.grantee <> c.relowner
        UNION
        SELECT DISTINCT c.oid::regclass::text, a.grantee
        FROM pg_catalog.pg_class AS c
        JOIN pg_catalog.pg_attribute AS t ON t.attrelid = c.oid AND t.attacl IS NOT NULL
        CROSS JOIN LATERAL pg_catalog.aclexplode(t.attacl) AS a
        WHERE c.oid IN (pg_catalog.to_regclass(pg_catalog.format('%I.capture_key', {schema_name}::text)),
                        pg_catalog.to_regclass(pg_catalog.format('%I.capture_keys', {schema_name}::text)))
          AND a.grantee <> c.relowner
    LOOP
        CONTINUE WHEN g.grantee <> 0
            AND pg_catalog.pg_get_userbyid(g.grantee) OPERATOR(pg_catalog.=) {relay_name}::text;
        EXECUTE pg_catalog.format('REVOKE ALL ON TABLE %s FROM %s', g.tab,
            CASE WHEN g.grantee = 0 THEN 'PUBLIC'
                 ELSE pg_catalog.quote_ident(pg_catalog.pg_get_userbyid(g.grantee)) END);
    END LOOP;
END

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

-- name: untrusted_schemas
-- Of these schemas (found by `--schemas GLOB`), those that a role other than the trusted owners
-- could have put code into that the relay would run with its own rights, and the first reason
-- for each (schema order): the schema or an object in it (a table, view, sequence, function,
-- type, operator, or the function of a trigger on one of its tables) owned by another role, or
-- another role (PUBLIC included) allowed to create in it or to add triggers to its tables.
-- Trusted: the roles named (--schema-owner), else the connecting role and the database's
-- owner; superusers always (they can do anything anyway).
WITH s AS (
    SELECT oid, nspname, nspowner, nspacl FROM pg_namespace WHERE nspname = ANY(%(schemas)s::text[])
), trusted AS (
    SELECT oid FROM pg_roles
    WHERE rolsuper
       OR (cardinality(%(owners)s::text[]) > 0 AND rolname = ANY(%(owners)s::text[]))
       OR (cardinality(%(owners)s::text[]) = 0 AND (rolname = current_user OR oid = (
              SELECT datdba FROM pg_database WHERE datname = current_database())))
), owned AS (
    SELECT s.nspname, 0 AS rank, 'the schema itself' AS what, s.nspowner AS owner FROM s
    UNION ALL
    SELECT s.nspname, 1, format('%%s %%I', CASE c.relkind WHEN 'v' THEN 'view' WHEN 'm' THEN 'view'
                                WHEN 'S' THEN 'sequence' WHEN 'i' THEN 'index' WHEN 'I' THEN 'index'
                                ELSE 'table' END, c.relname), c.relowner
    FROM s JOIN pg_class AS c ON c.relnamespace = s.oid
    UNION ALL
    SELECT s.nspname, 2, format('function %%I', p.proname), p.proowner
    FROM s JOIN pg_proc AS p ON p.pronamespace = s.oid
    UNION ALL
    SELECT s.nspname, 3, format('type %%I', t.typname), t.typowner
    FROM s JOIN pg_type AS t ON t.typnamespace = s.oid
    UNION ALL
    SELECT s.nspname, 4, format('operator %%s', o.oprname), o.oprowner
    FROM s JOIN pg_operator AS o ON o.oprnamespace = s.oid
    UNION ALL
    SELECT s.nspname, 5, format('function %%s of trigger %%I on %%I', p.oid::regprocedure, g.tgname, c.relname),
           p.proowner
    FROM s JOIN pg_class AS c ON c.relnamespace = s.oid
    JOIN pg_trigger AS g ON g.tgrelid = c.oid JOIN pg_proc AS p ON p.oid = g.tgfoid
), refused AS (
    SELECT nspname, rank, format('%%s is owned by %%s', what, pg_get_userbyid(owner)) AS why
    FROM owned WHERE owner NOT IN (SELECT oid FROM trusted)
    UNION ALL
    SELECT s.nspname, 6, format('%%s may create objects in it',
                                CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee) END)
    FROM s CROSS JOIN LATERAL aclexplode(s.nspacl) AS a
    WHERE a.privilege_type = 'CREATE' AND a.grantee NOT IN (SELECT oid FROM trusted)
    UNION ALL
    SELECT s.nspname, 7, format('%%s may add triggers to %%I',
                                CASE a.grantee WHEN 0 THEN 'PUBLIC' ELSE pg_get_userbyid(a.grantee) END, c.relname)
    FROM s JOIN pg_class AS c ON c.relnamespace = s.oid CROSS JOIN LATERAL aclexplode(c.relacl) AS a
    WHERE a.privilege_type = 'TRIGGER' AND a.grantee NOT IN (SELECT oid FROM trusted)
)
SELECT DISTINCT ON (nspname) nspname, why FROM refused ORDER BY nspname, rank, why

-- name: lock_timeout_set
-- How long this transaction's statements wait for a lock (outbox.store.lock_wait), set for the
-- transaction only; the setting before, to set back after a migration inside a caller's own.
SELECT current_setting('lock_timeout'), set_config('lock_timeout', %(timeout)s, true)

-- name: lock_holders
-- What a migration waited on: the transactions holding a lock on a table of its schema, oldest
-- first (their state and age are visible to the roles that may see them: NULL otherwise).
SELECT a.pid, a.application_name, a.state, extract(epoch FROM now() - a.xact_start)::float8
FROM pg_stat_activity AS a
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
  AND EXISTS (
      SELECT FROM pg_locks AS l
      JOIN pg_class AS c ON c.oid = l.relation
      JOIN pg_namespace AS n ON n.oid = c.relnamespace
      WHERE l.pid = a.pid AND l.granted AND n.nspname = %(schema)s
  )
ORDER BY a.xact_start NULLS LAST
LIMIT %(limit)s
