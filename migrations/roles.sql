-- outbox roles: least privilege for the two kinds of client.
--
-- Applied by `outbox migrate --roles` after the numbered migrations (again on
-- every run, so a new table's grants follow an upgrade). Placeholders: {schema},
-- {writer}, {relay} and {console} are identifiers, {sequence} the events id sequence,
-- {audit_sequence} the audit trail's.
-- The roles themselves are created (NOLOGIN) by `migrate` when they do not
-- exist, unless --no-create-roles; grant them to the login roles that apps and
-- relays connect as: GRANT outbox_writer TO orders_app;

-- The writer (the application): append events, nothing else. It cannot read,
-- change or delete any event, the archive or the dead letters. It inserts only the columns
-- an event is written with: the relay's (id, attempts, the lease, errors, created_at) are not
-- its to choose (an id given with OVERRIDING SYSTEM VALUE could land before other events).
REVOKE INSERT ON {schema}.events FROM {writer};
GRANT USAGE ON SCHEMA {schema} TO {writer};
GRANT INSERT (event_id, topic, key, payload, headers, type, subject, available_at, expires_at)
    ON {schema}.events TO {writer};
GRANT USAGE ON SEQUENCE {sequence} TO {writer};
-- The capture mode (table or WAL), read once per connection.
GRANT SELECT ON {schema}.capture TO {writer};
-- WAL capture: events are emitted, signed, only through emit_events (migration 0015).
GRANT EXECUTE ON FUNCTION {schema}.emit_events(bytea[]) TO {writer};

-- The relay: claim (SELECT ... FOR UPDATE needs UPDATE), retry (UPDATE), ack and
-- dead-letter (DELETE from events, INSERT into the archive and dead letters),
-- ownership leases and membership, and the archive's day partitions through the
-- SECURITY DEFINER function. No DDL, no TRUNCATE.
-- Reading everything also lets this role run `outbox status`.
GRANT USAGE ON SCHEMA {schema} TO {relay};
GRANT SELECT ON {schema}.schema_migrations TO {relay};
GRANT SELECT, UPDATE, DELETE ON {schema}.events TO {relay};
GRANT SELECT, INSERT ON {schema}.delivered TO {relay};
GRANT SELECT, INSERT ON {schema}.dead_letters TO {relay};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.relays TO {relay};
GRANT SELECT, UPDATE ON {schema}.partitions TO {relay};
-- WAL capture: the slot's handed-on position, and the events it puts into the table for a retry
-- (and the archive ids it takes from the events sequence). Reading the slot needs the login
-- role's own REPLICATION attribute (not inherited through membership).
GRANT SELECT, INSERT, DELETE ON {schema}.capture_positions TO {relay};
-- (capture's own position columns: where relays before migration 0014 keep it.)
GRANT SELECT, UPDATE (lsn, part_commit, part_events) ON {schema}.capture TO {relay};
GRANT INSERT ON {schema}.events TO {relay};
GRANT USAGE ON SEQUENCE {sequence} TO {relay};
-- ... and the keys their signatures are checked with (migrations 0015, 0021: rotated).
GRANT SELECT (key) ON {schema}.capture_key TO {relay};
GRANT SELECT (id, key, retire_at) ON {schema}.capture_keys TO {relay};
GRANT EXECUTE ON FUNCTION {schema}.ensure_delivered_partitions(integer) TO {relay};
-- The audit trail of operators' actions: read by `outbox audit` and `outbox status`.
GRANT SELECT ON {schema}.audit TO {relay};
-- Its own verifications (--verify-every: migration 0027), and the repairs a verify made.
GRANT SELECT, INSERT ON {schema}.verifications TO {relay};
GRANT USAGE ON SEQUENCE {schema}.verifications_id_seq TO {relay};
GRANT SELECT ON {schema}.repaired TO {relay};
-- The claim-check store (--claim-check-store postgres:): store, read, and purge old payloads.
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.claim_checks TO {relay};
-- Membership in the database's fleet (migration 0018): the one row whose lease keeps its
-- partitions in every outbox of the database.
GRANT USAGE ON SCHEMA outbox_fleet TO {relay};
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_fleet.relays TO {relay};
-- ... and the limits it shares with the outbox's other relays (--limit).
GRANT SELECT, INSERT, UPDATE, DELETE ON outbox_fleet.limits, outbox_fleet.limit_flights TO {relay};
GRANT EXECUTE ON FUNCTION outbox_fleet.limit_take(
    text, text, text, text, double precision, double precision, integer, integer, integer, uuid, integer) TO {relay};

-- The console (outbox console): read every table (but the WAL signing key); redrive (a dead
-- letter moves back into events under its own id: DELETE from dead_letters, INSERT into events),
-- skip (dead_letters.parked), replay (archived events queued again under new ids: the sequence);
-- each recorded in the audit trail. It cannot change or delete a pending event or the archive,
-- purge, or run DDL.
GRANT USAGE ON SCHEMA {schema} TO {console};
GRANT SELECT ON {schema}.schema_migrations, {schema}.events, {schema}.delivered, {schema}.dead_letters,
    {schema}.relays, {schema}.partitions, {schema}.claim_checks, {schema}.capture,
    {schema}.capture_positions, {schema}.verifications, {schema}.repaired TO {console};
GRANT INSERT ON {schema}.events TO {console};
GRANT USAGE ON SCHEMA outbox_fleet TO {console};
GRANT SELECT ON outbox_fleet.relays, outbox_fleet.limits, outbox_fleet.limit_flights TO {console};
GRANT USAGE ON SEQUENCE {sequence} TO {console};
GRANT DELETE, UPDATE (parked) ON {schema}.dead_letters TO {console};
-- The audit trail: read, and written only through its two functions (migration 0017), which set
-- who and when themselves: the console cannot insert other rows, or rewrite any.
REVOKE INSERT, UPDATE ON {schema}.audit FROM {console};
REVOKE USAGE ON SEQUENCE {audit_sequence} FROM {console};
GRANT SELECT ON {schema}.audit TO {console};
GRANT EXECUTE ON FUNCTION {schema}.audit_begin(text, text, text, jsonb, bigint),
    {schema}.audit_done(bigint, bigint) TO {console};
