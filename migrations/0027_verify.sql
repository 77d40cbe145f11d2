-- outbox 0027: `outbox verify` (issue 73). A delivered event is read back from its sink at the
-- coordinates the archive keeps; what a broker lost is queued again under its own event id.
--
-- repaired: the archived deliveries that verify found missing and queued again (`--repair`):
-- a later verify checks the new delivery, not the lost one. delivered_id is the archive row's id.
CREATE TABLE {schema}.repaired (
    delivered_id bigint PRIMARY KEY,
    event_id     uuid NOT NULL,
    repaired_at  timestamptz NOT NULL DEFAULT now(),
    audit_id     bigint
);

-- verifications: each verify's summary (the CLI's, the relay's own on its schedule), the latest
-- shown by the console and `outbox status`. missing_ids: the first of the missing, at most 100.
CREATE TABLE {schema}.verifications (
    id            bigserial PRIMARY KEY,
    at            timestamptz NOT NULL DEFAULT now(),
    via           text NOT NULL CHECK (via IN ('cli', 'relay')),
    since         timestamptz NOT NULL,
    until         timestamptz NOT NULL,
    checked       bigint NOT NULL,
    present       bigint NOT NULL,
    missing       bigint NOT NULL,
    expired       bigint NOT NULL,
    unverifiable  bigint NOT NULL,
    missing_ids   uuid[] NOT NULL DEFAULT ARRAY[]::uuid[]
);

-- The audit trail records a repair as it records a replay.
ALTER TABLE {schema}.audit DROP CONSTRAINT audit_action_check;
ALTER TABLE {schema}.audit ADD CONSTRAINT audit_action_check
    CHECK (action IN ('redrive', 'skip', 'replay', 'purge', 'repair'));
