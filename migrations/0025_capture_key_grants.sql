-- outbox 0025: WAL capture's signing keys are read by their owner and the roles granted their
-- columns alone (issue 70).
--
-- 0015 and 0021 revoked the key tables from PUBLIC only. A role given SELECT on the schema's future
-- tables (ALTER DEFAULT PRIVILEGES ... GRANT SELECT ON TABLES, a common set-up for reporting) got
-- SELECT on capture_key and capture_keys when the migrations made them, read the key, and signed a
-- message the relay delivered under an id it chose. Every table-level privilege of a role other
-- than the owner goes here (default privileges and GRANT ... ON ALL TABLES give table-level ones);
-- the column grants that name the key (the relay role's, by `migrate --roles` or by hand) stay:
-- REVOKE on a table revokes its column grants too, so each is granted again. `migrate --roles`
-- and `migrate --check-grants` see to the rest.
DO $do$
DECLARE
    g record;
    who text;
    regrants text[];
    one text;
BEGIN
    FOR g IN
        SELECT DISTINCT c.oid AS tab, a.grantee
        FROM pg_class AS c CROSS JOIN LATERAL aclexplode(c.relacl) AS a
        WHERE c.oid IN (to_regclass(format('%I.capture_key', {schema_name})),
                        to_regclass(format('%I.capture_keys', {schema_name})))
          AND a.grantee <> c.relowner
    LOOP
        who := CASE WHEN g.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(g.grantee)) END;
        SELECT array_agg(format('GRANT %s (%I) ON TABLE %s TO %s', a.privilege_type, t.attname,
                                g.tab::regclass, who))
        INTO regrants
        FROM pg_attribute AS t CROSS JOIN LATERAL aclexplode(t.attacl) AS a
        WHERE t.attrelid = g.tab AND t.attacl IS NOT NULL AND a.grantee = g.grantee;
        EXECUTE format('REVOKE ALL ON TABLE %s FROM %s', g.tab::regclass, who);
        FOREACH one IN ARRAY coalesce(regrants, '{{}}') LOOP
            EXECUTE one;
        END LOOP;
    END LOOP;
END
$do$;
