-- outbox 0013: how events are captured, table or WAL (issue 30).
--
-- One row. `mode` is what `enqueue` reads (once per connection): 'table' inserts a row into
-- events; 'wal' emits a transactional logical decoding message (pg_logical_emit_message) that
-- the relay reads from the replication slot `slot` (publication `publication`, for pgoutput).
-- `outbox migrate --capture wal|table` switches it and creates the slot and the publication.
-- `lsn`: the end of the last WAL transaction whose events were all handed on (delivered and
-- archived, or put into events for a retry), written in the same transaction as they were; a
-- relay skips what the slot sends again below it, so nothing is archived twice. A large
-- transaction is handed on in pieces: `part_commit` (the LSN of its commit record) and
-- `part_events` say how many of its events are handed on so far (NULL and 0 between
-- transactions).
CREATE TABLE {schema}.capture (
    only_row    boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    mode        text        NOT NULL DEFAULT 'table' CHECK (mode IN ('table', 'wal')),
    slot        text,
    publication text,
    lsn         pg_lsn,
    part_commit pg_lsn,
    part_events integer     NOT NULL DEFAULT 0,
    switched_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {schema}.capture DEFAULT VALUES;
