-- outbox 0018: relays' membership per database, not per outbox (issue 45).
--
-- A relay serving a thousand outboxes of one database renewed its leases in each of them: a
-- heartbeat per outbox, 500 statements a second for nothing. Now a relay's partition leases in
-- every schema of a database last as long as its one row here: its membership, renewed by one
-- statement every lease / 5. An outbox's own rows (`relays`, `partitions`) change only when its
-- ownership does: a relay joins or leaves it, or one died.
--
-- `partitions.expires_at` of a relay of this version is 'infinity' (the lease is the owner's
-- row here); a relay of an earlier version keeps renewing its own, so during an upgrade
-- neither takes a partition the other still holds.
-- The schema is shared by every outbox of the database: created once, by the first outbox migrated
-- to this version (a relay serving outboxes found by a glob refuses it unless a trusted role owns
-- it, like a tenant's schema). Its objects are created only when missing: a tenant migrating its
-- own outbox later neither needs nor has the right to touch them.
SELECT pg_advisory_xact_lock(hashtext('outbox_fleet'), 0);
DO $do$
BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'outbox_fleet') THEN
    CREATE SCHEMA outbox_fleet;
END IF;
IF NOT EXISTS (SELECT 1 FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = 'outbox_fleet' AND c.relname = 'relays') THEN
CREATE TABLE outbox_fleet.relays (
    id            uuid PRIMARY KEY,
    name          text NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,              -- the lease of every partition it owns
    lease_seconds double precision NOT NULL,         -- its batch lease
    backend_pids  integer[] NOT NULL DEFAULT '{{}}',
    readiness     text,                              -- the kind of its /readyz at the last heartbeat
    changed_at    timestamptz NOT NULL DEFAULT now() -- when it last joined or left an outbox
);
END IF;
END
$do$;

-- Limits per destination (`outbox relay --limit GLOB=SPEC`), shared by every relay of an outbox:
-- a token bucket per outbox (its schema) and limit (its glob), and each relay's events in flight.
-- `spec` and `pattern` (its topics, as a regular expression) are as the relays last gave them,
-- for `outbox status` and the console.
DO $do$
BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = 'outbox_fleet' AND c.relname = 'limits') THEN
CREATE TABLE outbox_fleet.limits (
    outbox   text NOT NULL,
    glob     text NOT NULL,
    spec     text NOT NULL,
    pattern  text NOT NULL,
    tokens   double precision NOT NULL,
    at       timestamptz NOT NULL,
    PRIMARY KEY (outbox, glob)
);
END IF;
IF NOT EXISTS (SELECT 1 FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
               WHERE n.nspname = 'outbox_fleet' AND c.relname = 'limit_flights') THEN
CREATE TABLE outbox_fleet.limit_flights (
    outbox    text NOT NULL,
    glob      text NOT NULL,
    relay     uuid NOT NULL,
    in_flight integer NOT NULL,
    PRIMARY KEY (outbox, glob, relay)
);
END IF;
END
$do$;

-- Take tokens for up to p_want events: as many as the bucket holds whole (refilled at p_rate a
-- second up to p_burst since it was last taken from) and the in-flight cap leaves beside the
-- other live relays' events in flight; none unless the bucket holds p_least (a batch of a few
-- events, not one event a claim). The bucket's row is locked for it: relays taking at once
-- take in turn. Returns what it granted, and, when it granted nothing for the rate, the seconds
-- until the next token. The caller's events in flight become p_flying + granted.
-- Created once (by the first outbox migrated to this version): another migrating role could not
-- replace it, and need not.
DO $do$
BEGIN
IF NOT EXISTS (SELECT 1 FROM pg_proc AS p JOIN pg_namespace AS n ON n.oid = p.pronamespace
               WHERE n.nspname = 'outbox_fleet' AND p.proname = 'limit_take') THEN
CREATE FUNCTION outbox_fleet.limit_take(
    p_outbox text, p_glob text, p_spec text, p_pattern text, p_rate double precision,
    p_burst double precision, p_least integer, p_cap integer, p_want integer, p_me uuid,
    p_flying integer, OUT granted integer, OUT wait double precision)
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    stamp timestamptz := clock_timestamp();
    avail double precision;
    others integer := 0;
BEGIN
    INSERT INTO outbox_fleet.limits (outbox, glob, spec, pattern, tokens, at)
    VALUES (p_outbox, p_glob, p_spec, p_pattern, p_burst, stamp)
    ON CONFLICT (outbox, glob) DO NOTHING;
    SELECT CASE WHEN p_rate IS NULL THEN p_want
                ELSE least(p_burst, l.tokens + p_rate * extract(epoch FROM stamp - l.at)) END
    INTO avail
    FROM outbox_fleet.limits AS l WHERE l.outbox = p_outbox AND l.glob = p_glob
    FOR UPDATE;
    granted := least(p_want, floor(avail)::integer);
    IF granted < least(p_want, p_least) THEN
        granted := 0;
    END IF;
    IF p_cap IS NOT NULL THEN
        SELECT coalesce(sum(u.in_flight), 0) INTO others
        FROM outbox_fleet.limit_flights AS u
        JOIN outbox_fleet.relays AS f ON f.id = u.relay AND f.expires_at > now()
        WHERE u.outbox = p_outbox AND u.glob = p_glob AND u.relay <> p_me;
        granted := least(granted, p_cap - others - p_flying);
    END IF;
    granted := greatest(granted, 0);
    IF p_cap IS NOT NULL THEN
        INSERT INTO outbox_fleet.limit_flights (outbox, glob, relay, in_flight)
        VALUES (p_outbox, p_glob, p_me, p_flying + granted)
        ON CONFLICT (outbox, glob, relay) DO UPDATE SET in_flight = excluded.in_flight;
    END IF;
    wait := 0;
    IF p_rate IS NOT NULL THEN
        UPDATE outbox_fleet.limits
        SET tokens = avail - granted, at = stamp, spec = p_spec, pattern = p_pattern
        WHERE outbox = p_outbox AND glob = p_glob;
        IF granted = 0 AND avail < least(p_want, p_least) THEN
            wait := (least(p_want, p_least) - avail) / p_rate;
        END IF;
    ELSE
        UPDATE outbox_fleet.limits SET at = stamp, spec = p_spec, pattern = p_pattern
        WHERE outbox = p_outbox AND glob = p_glob AND (spec <> p_spec OR pattern <> p_pattern);
    END IF;
END
$$;
REVOKE EXECUTE ON FUNCTION outbox_fleet.limit_take(
    text, text, text, text, double precision, double precision, integer, integer, integer, uuid, integer) FROM PUBLIC;
END IF;
END
$do$;
