-- outbox 0010: each relay's readiness as of its last heartbeat ("ready", "sink down",
-- "stalled", "database unreachable", "starting", "draining", "sink unhealthy"), so that
-- `outbox status` and the console show the fleet's state without scraping every relay's
-- /readyz. Only the kind: the detail, which may name a sink, stays on /readyz and in the log.
ALTER TABLE {schema}.relays ADD COLUMN readiness text;
