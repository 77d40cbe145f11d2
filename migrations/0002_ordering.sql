-- outbox 0002: per-key order across many relay processes, and parked keys.
--
-- Every event belongs to one of 64 logical partitions: the hash of its key, or
-- of its event id when it has no key (null keys carry no order and spread
-- freely). Live relays share the partitions through leases in `partitions`;
-- a relay claims only events of partitions it owns, so one key is only ever
-- delivered by one process at a time.

ALTER TABLE {schema}.events
    ADD COLUMN partition smallint NOT NULL GENERATED ALWAYS AS (
        hashtext(CASE WHEN key IS NULL THEN event_id::text ELSE encode(key, 'hex') END) & 63
    ) STORED;

-- Relay processes, for membership (fair shares) and for `outbox status`.
CREATE TABLE {schema}.relays (
    id            uuid PRIMARY KEY,
    name          text NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    expires_at    timestamptz NOT NULL,
    lease_seconds double precision NOT NULL,  -- its batch lease: how long a stale batch may hold locks
    backend_pids  integer[] NOT NULL DEFAULT '{{}}',
    ordering      text NOT NULL
);

-- Ownership leases. `fenced_until`: a partition taken from an owner whose lease
-- expired may still have rows locked by that owner's stalled batch; its new
-- owner claims nothing from it until that batch's session is gone.
CREATE TABLE {schema}.partitions (
    partition      smallint PRIMARY KEY,
    owner          uuid,
    expires_at     timestamptz,
    releasing      boolean NOT NULL DEFAULT false,
    fenced_until   timestamptz,
    previous_owner uuid,
    acquired_at    timestamptz
);
INSERT INTO {schema}.partitions (partition) SELECT generate_series(0, 63);

-- Parked keys: a dead letter with parked = true holds back the later events of
-- its key until it is redriven or skipped.
ALTER TABLE {schema}.dead_letters ADD COLUMN parked boolean NOT NULL DEFAULT false;
CREATE INDEX dead_letters_parked_key_idx ON {schema}.dead_letters (key, id) WHERE parked;
