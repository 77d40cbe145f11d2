-- outbox 0013: how events are captured, table or WAL (issue 30).
--
-- One row. `mode` is what `enqueue` reads (once per connection): 'table' inserts a row into
-- events; 'wal' emits a transactional logical decoding message (pg_logical_emit_message) that
-- the relay reads from the replication slot `slot` (publication `publication`, for pgoutput).
-- `outbox migrate --capture wal|table` switches it and creates the slot and the publication.
-- `lsn`: the end of the last WAL transaction whose events were all handed on (delivered and
-- archived, or put into events for a retry), written in the same transaction as they were; a
-- relay skips what the slot sends again below it, so nothing is archived twice.
CREATE TABLE {schema}.capture (
    only_row    boolean     PRIMARY KEY DEFAULT true CHECK (only_row),
    mode        text        NOT NULL DEFAULT 'table' CHECK (mode IN ('table', 'wal')),
    slot        text,
    publication text,
    lsn         pg_lsn,
    switched_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO {schema}.capture DEFAULT VALUES;
