-- Named queries of the grants audit (outbox.grants, `outbox migrate --check-grants`).

-- name: grants_audit
-- Who, outside the trusted roles, could put code where the project's sessions would run it:
-- CREATE on the database (schemas: one named after another role is first on that role's
-- search_path, or outbox_fleet before the project makes it), CREATE in public (overloads on every
-- role's default search_path), CREATE in an outbox's schema or in outbox_fleet; and schemas
-- named after a login role that another role owns (a "$user" schema planted for it). PUBLIC's
-- grants are one row (grantee NULL); a role's own row only when it has more than PUBLIC has.
-- And who may read WAL capture's signing keys in these schemas (capture_key, capture_keys), but
-- the relay role and the roles that reach them through it: a key reader can sign messages the
-- relay delivers as events. Table and column grants, default privileges and pg_read_all_data
-- all count (has_column_privilege sees each); place 'key', or 'key_all_data' through
-- pg_read_all_data (PostgreSQL 14+), which no REVOKE on the tables reaches.
-- Trusted: the roles named (--schema-owner), else the connecting role and the database's owner;
-- superusers always: untrusted_schemas' CTE word for word (tests/unit/test_queries.py).
WITH trusted AS (
    SELECT oid FROM pg_roles
    WHERE rolsuper
       OR (cardinality(%(owners)s::text[]) > 0 AND rolname = ANY(%(owners)s::text[]))
       OR (cardinality(%(owners)s::text[]) = 0 AND (rolname = current_user OR oid = (
              SELECT datdba FROM pg_database WHERE datname = current_database())))
), others AS (
    SELECT oid, rolname FROM pg_roles
    WHERE oid NOT IN (SELECT oid FROM trusted) AND rolname !~ '^pg_'
), places AS (
    SELECT oid, nspname, nspacl FROM pg_namespace
    WHERE nspname = ANY(%(schemas)s::text[]) OR nspname IN ('public', 'outbox_fleet')
), keys AS (
    SELECT n.nspname, c.oid AS tab, c.relowner
    FROM pg_namespace AS n JOIN pg_class AS c ON c.relnamespace = n.oid
    WHERE n.nspname = ANY(%(schemas)s::text[]) AND c.relname IN ('capture_key', 'capture_keys')
      AND c.relkind = 'r'
), public_create AS (
    SELECT 'database'::text AS place, current_database()::text AS name
    FROM pg_database AS d CROSS JOIN LATERAL aclexplode(coalesce(d.datacl, acldefault('d', d.datdba))) AS a
    WHERE d.datname = current_database() AND a.grantee = 0 AND a.privilege_type = 'CREATE'
    UNION ALL
    SELECT 'schema', p.nspname
    FROM places AS p CROSS JOIN LATERAL aclexplode(p.nspacl) AS a
    WHERE a.grantee = 0 AND a.privilege_type = 'CREATE'
)
SELECT NULL::text AS grantee, place, name FROM public_create
UNION ALL
SELECT o.rolname, 'database', current_database()::text
FROM others AS o
WHERE has_database_privilege(o.oid, current_database(), 'CREATE')
  AND NOT EXISTS (SELECT 1 FROM public_create WHERE place = 'database')
UNION ALL
SELECT o.rolname, 'schema', p.nspname
FROM others AS o CROSS JOIN places AS p
WHERE has_schema_privilege(o.oid, p.oid, 'CREATE')
  AND NOT EXISTS (SELECT 1 FROM public_create AS c WHERE c.place = 'schema' AND c.name = p.nspname)
UNION ALL
SELECT pg_get_userbyid(n.nspowner), 'named', n.nspname
FROM pg_namespace AS n JOIN pg_roles AS r ON r.rolname = n.nspname
WHERE n.nspowner <> r.oid AND n.nspowner NOT IN (SELECT oid FROM trusted)
UNION ALL
SELECT DISTINCT o.rolname,
       CASE WHEN EXISTS (SELECT 1 FROM pg_roles AS p
                         WHERE p.rolname = 'pg_read_all_data' AND pg_has_role(o.oid, p.oid, 'USAGE'))
            THEN 'key_all_data' ELSE 'key' END,
       k.nspname
FROM others AS o CROSS JOIN keys AS k
WHERE o.oid <> k.relowner
  AND NOT EXISTS (SELECT 1 FROM pg_roles AS r WHERE r.rolname = %(relay)s AND pg_has_role(o.oid, r.oid, 'USAGE'))
  AND has_column_privilege(o.oid, k.tab, 'key', 'SELECT')
ORDER BY 2, 3, 1 NULLS FIRST
