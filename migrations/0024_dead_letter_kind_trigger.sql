-- outbox 0024: a dead letter gets its kind whoever inserts it (a relay of 0.2.0 during a roll too).
--
-- 0020 gave the dead letters already there their kind, from the reasons the relay gave them. A
-- 0.2.0 relay that still serves the outbox while the relays are rolled inserts its dead letters
-- without one. A stranger's WAL message it dead-lettered (unsigned_event) was then taken by a
-- bulk redrive, which takes unverified events only by id, and a catch-all route delivered the
-- stranger's content. This trigger gives such a row its kind from the same reasons. The rows this
-- version's relays insert carry theirs, and the trigger's WHEN skips them.
CREATE FUNCTION {schema}.dead_letter_kind() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NEW.topic = '(unsigned)'
       AND NEW.error LIKE 'a WAL message under % whose signature does not verify%' THEN
        NEW.kind := 'unsigned_event';
    ELSIF NEW.error LIKE 'a signed WAL message that is no outbox event:%'
          OR NEW.error LIKE 'corrupt event row:%' THEN
        NEW.kind := 'corrupt_event';
    END IF;
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION {schema}.dead_letter_kind() FROM PUBLIC;
CREATE TRIGGER dead_letter_kind BEFORE INSERT ON {schema}.dead_letters
FOR EACH ROW WHEN (NEW.kind IS NULL) EXECUTE FUNCTION {schema}.dead_letter_kind();
-- And the rows a 0.2.0 relay inserted since 0020.
UPDATE {schema}.dead_letters SET kind = 'unsigned_event'
WHERE kind IS NULL AND topic = '(unsigned)'
  AND error LIKE 'a WAL message under % whose signature does not verify%';
UPDATE {schema}.dead_letters SET kind = 'corrupt_event'
WHERE kind IS NULL AND (error LIKE 'a signed WAL message that is no outbox event:%'
                        OR error LIKE 'corrupt event row:%');
