-- outbox 0014: WAL capture's handed-on position appended, not updated (issue 30).
--
-- 0013 kept the position in capture's one row, updated by every WAL batch. Each update leaves
-- a dead row version, and while a snapshot is held open none can be removed: every update
-- then read them all (0.37 ms an update, 1.13 ms after 120,000 of them under a held snapshot;
-- the relay's commit -> ack p50 rose from 1.7 to 5.3 ms in ten minutes at 1,000 events/s).
-- A position is now a row of its own. A WAL batch inserts its position and deletes those it
-- supersedes among the last few rows (by id), so one or two rows are live and no statement
-- walks the dead ones. The handed-on position is the greatest (the last entry of the
-- position index): a reader that lost the slot may still finish a batch with a lower one,
-- which never counts. capture's columns stay, as migrations are additive: a relay of the release
-- before this one keeps updating them until it is replaced, and the position read is the
-- greater of the two (capture.sql, capture_state), so a rolling upgrade hands it on.
-- `lsn`: the end of the last WAL transaction whose events were all handed on; inside a large
-- transaction, `part_commit` (its commit record's LSN) and `part_events`
-- (how many of its events are handed on so far; NULL and 0 between transactions).
CREATE TABLE {schema}.capture_positions (
    id          bigint  GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    lsn         pg_lsn,
    part_commit pg_lsn,
    part_events integer NOT NULL DEFAULT 0
);
CREATE INDEX capture_positions_position_idx ON {schema}.capture_positions
    ((coalesce(part_commit, lsn, '0/0'::pg_lsn)), (CASE WHEN part_commit IS NULL THEN 0 ELSE part_events END));
