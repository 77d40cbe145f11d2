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
-- The schema is shared by every outbox of the database; its table is created once.
SELECT pg_advisory_xact_lock(hashtext('outbox_fleet'), 0);
CREATE SCHEMA IF NOT EXISTS outbox_fleet;
CREATE TABLE IF NOT EXISTS outbox_fleet.relays (
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
