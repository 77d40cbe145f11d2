-- outbox 0021: WAL capture's signing key can be rotated (`outbox capture rotate-key`, issue 56).
--
-- A leaked key lets its holder sign messages the relay delivers as the outbox's events. The keys
-- now live in capture_keys, newest last: emit_events signs with the newest; the relay's reader
-- verifies a message with each key that was not retired when the message's transaction committed
-- (retire_at: the rotation's time plus its window, in which both keys verify). A rotation writes,
-- in its own transaction, a message under the outbox's prefix signed with the key it retires: in
-- WAL order, before any message signed with the new key, it tells the reader to read the keys
-- again. capture_key keeps the newest key too, for a relay of an earlier version (rotate once
-- every relay runs this one: an earlier reader knows one key). The roles that may read
-- capture_key's key (the relay role, `migrate --roles`) may read these.
CREATE TABLE {schema}.capture_keys (
    id          integer     GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key         bytea       NOT NULL,
    ipad        bytea       NOT NULL,
    opad        bytea       NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    retire_at   timestamptz,  -- what commits at or after it no longer verifies with this key
    retired_lsn pg_lsn        -- the rotation's place in the WAL (the key is dropped once read past it)
);
REVOKE ALL ON {schema}.capture_keys FROM PUBLIC;
INSERT INTO {schema}.capture_keys (key, ipad, opad) SELECT key, ipad, opad FROM {schema}.capture_key;
DO $do$
DECLARE
    grantee text;
BEGIN
    FOR grantee IN
        SELECT DISTINCT pg_get_userbyid(a.grantee)
        FROM pg_attribute AS c CROSS JOIN LATERAL aclexplode(c.attacl) AS a
        WHERE c.attrelid = to_regclass(format('%I.capture_key', {schema_name})) AND c.attname = 'key'
          AND a.privilege_type = 'SELECT' AND a.grantee <> 0
    LOOP
        EXECUTE format('GRANT SELECT (id, key, retire_at) ON %I.capture_keys TO %I', {schema_name}, grantee);
    END LOOP;
END
$do$;

CREATE OR REPLACE FUNCTION {schema}.emit_events(messages bytea[]) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    inner_pad bytea;
    outer_pad bytea;
    emitted bigint;
BEGIN
    SELECT ipad, opad INTO STRICT inner_pad, outer_pad FROM {schema}.capture_keys ORDER BY id DESC LIMIT 1;
    SELECT count(pg_logical_emit_message(true, 'outbox:' || {schema_name},
                 sha256(outer_pad || sha256(inner_pad || c)) || c))
    INTO emitted
    FROM (SELECT convert_to(extract(epoch FROM clock_timestamp())::text, 'UTF8') || '\x0a'::bytea || m
          FROM unnest(messages) WITH ORDINALITY AS x (m, n)
          ORDER BY n) AS y (c);
    RETURN emitted;
END
$$;
