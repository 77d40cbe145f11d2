-- Named queries of a relay's membership in its database (outbox.membership, migration 0018).
-- Each block starts with `-- name: <name>` and a one-line comment. The membership table is
-- outbox_fleet.relays, one per database, shared by every outbox in it; {schema} is unused.
-- Every value is a bound parameter. Literal braces are doubled.

-- name: fleet_heartbeat
-- Register or renew this relay's membership: the lease of every partition it owns in every
-- outbox of the database, in one statement. %(changed)s: it joined or left an outbox since
-- its last heartbeat. Returns a digest of the other live members and when each last joined or
-- left an outbox: when it changes, the relay looks at the ownership of each outbox it serves
-- (a relay came, went, or serves other outboxes now); while it stays, nothing there moved.
WITH beat AS (
    INSERT INTO outbox_fleet.relays (id, name, expires_at, lease_seconds, backend_pids, readiness)
    VALUES (%(me)s, %(name)s, now() + %(ttl)s * interval '1 second', %(lease)s,
            %(pids)s::text::integer[], %(readiness)s)
    ON CONFLICT (id) DO UPDATE
    SET heartbeat_at = now(), expires_at = excluded.expires_at, backend_pids = excluded.backend_pids,
        readiness = excluded.readiness,
        changed_at = CASE WHEN %(changed)s THEN now() ELSE outbox_fleet.relays.changed_at END
)
SELECT md5(coalesce(string_agg(id::text || '@' || changed_at::text, ',' ORDER BY id), ''))
FROM outbox_fleet.relays
WHERE expires_at > now() AND id <> %(me)s

-- name: fleet_leave
-- Clean shutdown: leave the membership (its outboxes' partitions were handed over already).
DELETE FROM outbox_fleet.relays WHERE id = %(me)s

-- name: fleet_forget
-- Drop the memberships of relays that have been gone for a while.
DELETE FROM outbox_fleet.relays WHERE expires_at < now() - interval '10 minutes'

-- name: limit_take
-- Tokens of a limit for up to %(want)s events of an outbox, shared by every relay serving it
-- (outbox.limits; the function is migration 0018's). Returns (granted, seconds to the next token).
SELECT granted, wait
FROM outbox_fleet.limit_take(%(outbox)s, %(glob)s, %(spec)s, %(pattern)s, %(rate)s, %(burst)s,
                             %(least)s, %(cap)s, %(want)s, %(me)s, %(flying)s)

-- name: limit_report
-- This relay's events in flight of a capped limit, as they are now (a batch of it finished, or a
-- claim took fewer than it had tokens for), and the tokens it took and could not use (%(back)s),
-- back into the bucket for the other relays.
WITH flights AS (
    UPDATE outbox_fleet.limit_flights SET in_flight = %(flying)s
    WHERE %(capped)s AND outbox = %(outbox)s AND glob = %(glob)s AND relay = %(me)s
)
UPDATE outbox_fleet.limits SET tokens = least(%(burst)s, tokens + %(back)s)
WHERE %(back)s > 0 AND outbox = %(outbox)s AND glob = %(glob)s

-- name: limit_forget
-- The in-flight rows of relays gone for a while.
DELETE FROM outbox_fleet.limit_flights AS u
WHERE NOT EXISTS (SELECT 1 FROM outbox_fleet.relays AS f WHERE f.id = u.relay)
