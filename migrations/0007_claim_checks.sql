-- outbox 0007: the claim-check store in PostgreSQL (relay --claim-check-store postgres:).
--
-- A payload over --claim-check-over bytes is stored here, keyed by its event id, before
-- its message is produced; the message carries the reference instead of the body.
-- Written again with the same key when the event is retried. `outbox purge` deletes rows
-- stored before its cutoff, with the archive's partitions of those days.
CREATE TABLE {schema}.claim_checks (
    event_id  uuid        PRIMARY KEY,
    stored_at timestamptz NOT NULL DEFAULT now(),
    payload   bytea       NOT NULL
);
CREATE INDEX claim_checks_stored_at_idx ON {schema}.claim_checks (stored_at);
