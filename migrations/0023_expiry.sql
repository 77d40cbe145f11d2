-- outbox 0023: events that expire (issue 60).
--
-- `enqueue(..., expires_at=...)`: an event only useful for a while (a notification, a price) is
-- not delivered late after an outage. The relay dead-letters one it claims at or after its
-- expires_at, with the kind `expired`, which never parks its key. The dead letter keeps the
-- time, so that redriving any other dead letter keeps its expiry; an expired one is redriven only
-- with --include-expired, and then without it. Nullable columns without a default: no rewrite,
-- and writers and relays of earlier versions go on beside this one (they name their columns).
ALTER TABLE {schema}.events ADD COLUMN expires_at timestamptz;
ALTER TABLE {schema}.dead_letters ADD COLUMN expires_at timestamptz;
