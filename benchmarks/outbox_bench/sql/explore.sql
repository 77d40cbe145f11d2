-- Named queries of the schedule explorer (outbox_bench.explore.world): its writer's, its
-- operator's and its checker's looks at an outbox. Events are told apart by their payload's
-- "n" (the explorer's own numbering), never by the relay's ids.

-- name: explore_archived
-- The payload of every archived event (a row each: an event archived twice shows twice).
SELECT payload FROM {schema}.delivered

-- name: explore_dead
-- The payload, error and parked flag of every dead letter.
SELECT payload, error, parked FROM {schema}.dead_letters

-- name: explore_pending
-- The payload of every pending event.
SELECT payload FROM {schema}.events

-- name: explore_parked
-- The payload of every pending event behind a parked dead letter of its key.
SELECT e.payload FROM {schema}.events AS e
WHERE EXISTS (SELECT 1 FROM {schema}.dead_letters AS d WHERE d.key = e.key AND d.parked AND d.id < e.id)

-- name: explore_dead_letters
-- The operator's choice: every dead letter (to redrive), or every parked one (to skip).
SELECT id, payload FROM {schema}.dead_letters WHERE parked OR NOT %(parked_only)s

-- name: explore_terminate
-- End the database sessions of one relay (by the application_name of its DSN).
SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %(name)s

-- name: explore_drop_slot
-- The replication slot of a WAL capture schedule, once it is no longer read.
SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
WHERE slot_name = %(slot)s AND NOT active
