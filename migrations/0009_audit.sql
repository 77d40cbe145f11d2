-- outbox 0009: the audit trail of what operators did to events.
--
-- Every redrive, skip, replay and purge, from the CLI or the console, is one row: who (the
-- operator, and the database role they acted as), when, through what, the selector (filters,
-- the high-water mark of the ids it acted on, the time window) and how many were planned and
-- done. `done` stays NULL when an action that commits chunk by chunk (replay, purge) did not
-- finish.
CREATE TABLE {schema}.audit (
    id bigserial PRIMARY KEY,
    at timestamptz NOT NULL DEFAULT now(),
    actor text NOT NULL,
    db_user text NOT NULL DEFAULT current_user,
    via text NOT NULL CHECK (via IN ('cli', 'console')),
    action text NOT NULL CHECK (action IN ('redrive', 'skip', 'replay', 'purge')),
    selector jsonb NOT NULL,
    planned bigint NOT NULL,
    done bigint,
    finished_at timestamptz
);
CREATE INDEX audit_at ON {schema}.audit (at);
