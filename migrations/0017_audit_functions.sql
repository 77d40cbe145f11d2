-- outbox 0017: the audit trail written only through two functions (issue 43).
--
-- The console's role could insert audit rows naming anyone (db_user, at) and update any row's
-- outcome. Now a row is begun by audit_begin, which sets db_user (the session's login role,
-- whatever the caller claims) and the time itself, and finished once by audit_done, only by
-- the role that began it. roles.sql takes the console role's INSERT and UPDATE away and grants
-- it these two (SECURITY DEFINER: they write as the migrating role).
CREATE FUNCTION {schema}.audit_begin(p_actor text, p_via text, p_action text, p_selector jsonb, p_planned bigint)
RETURNS bigint LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO {schema}.audit (actor, db_user, via, action, selector, planned, at)
    VALUES (p_actor, session_user, p_via, p_action, p_selector, p_planned, now())
    RETURNING id
$$;

-- How many the action did; true if this call recorded it (once, by the role that began it).
CREATE FUNCTION {schema}.audit_done(p_id bigint, p_done bigint)
RETURNS boolean LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH finished AS (
        UPDATE {schema}.audit SET done = p_done, finished_at = now()
        WHERE id = p_id AND finished_at IS NULL AND db_user = session_user
        RETURNING 1
    )
    SELECT count(*) = 1 FROM finished
$$;
REVOKE EXECUTE ON FUNCTION {schema}.audit_begin(text, text, text, jsonb, bigint) FROM PUBLIC;
REVOKE EXECUTE ON FUNCTION {schema}.audit_done(bigint, bigint) FROM PUBLIC;
