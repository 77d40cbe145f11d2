-- outbox 0015: WAL capture's messages are signed, so that only the outbox's writers can have
-- an event delivered (issue 43).
--
-- pg_logical_emit_message is executable by every role (PostgreSQL's default), and a message
-- under the outbox's prefix was an event to the relay: any role that could log in could have
-- an event of its choosing delivered, under a chosen event id. Writers now emit through
-- emit_events(), a SECURITY DEFINER function that fixes the prefix, adds the creation time and
-- signs each message with HMAC-SHA256 under the outbox's own key. Only the function's owner
-- and the relay read the key (capture_key); only the writer role may execute the function
-- (roles.sql). The relay dead-letters a message whose signature does not verify, as
-- unsigned, without its key or id: it can neither be delivered nor park a key.
--
-- The key: 32 bytes from gen_random_uuid() (PostgreSQL's strong random source; 244 of the
-- 256 bits are random). HMAC's pads (the key, zero-padded to SHA-256's 64-byte block, XOR
-- 0x36 and 0x5c) are kept beside it, so signing is two sha256() calls: no extension needed.
CREATE TABLE {schema}.capture_key (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    key      bytea   NOT NULL,
    ipad     bytea   NOT NULL,
    opad     bytea   NOT NULL
);
REVOKE ALL ON {schema}.capture_key FROM PUBLIC;
INSERT INTO {schema}.capture_key (key, ipad, opad)
SELECT k,
       (SELECT string_agg(set_byte('\x00'::bytea, 0, get_byte(p, i) # 54), '' ORDER BY i)
        FROM generate_series(0, 63) AS i),
       (SELECT string_agg(set_byte('\x00'::bytea, 0, get_byte(p, i) # 92), '' ORDER BY i)
        FROM generate_series(0, 63) AS i)
FROM (SELECT k, k || '\x0000000000000000000000000000000000000000000000000000000000000000'::bytea AS p
      FROM (SELECT uuid_send(gen_random_uuid()) || uuid_send(gen_random_uuid()) AS k) AS random_key
     ) AS key_and_block;

-- One transactional logical decoding message per event, in order: the signature (32 bytes),
-- then the creation time (epoch seconds, text, the server's clock), a line break, and the
-- event's encoding (outbox.capture.encode). Returns how many were emitted.
CREATE FUNCTION {schema}.emit_events(messages bytea[]) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    inner_pad bytea;
    outer_pad bytea;
    emitted bigint;
BEGIN
    SELECT ipad, opad INTO STRICT inner_pad, outer_pad FROM {schema}.capture_key;
    SELECT count(pg_logical_emit_message(true, 'outbox:' || {schema_name},
                 sha256(outer_pad || sha256(inner_pad || c)) || c))
    INTO emitted
    FROM (SELECT convert_to(extract(epoch FROM clock_timestamp())::text, 'UTF8') || '\x0a'::bytea || m
          FROM unnest(messages) WITH ORDINALITY AS x (m, n)
          ORDER BY n) AS y (c);
    RETURN emitted;
END
$$;
REVOKE EXECUTE ON FUNCTION {schema}.emit_events(bytea[]) FROM PUBLIC;
