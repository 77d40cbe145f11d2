-- outbox 0024: a dead letter gets its kind whoever inserts it (a relay of 0.2.0 during a roll too).
--
-- 0020 gave the dead letters already there their kind, from the reasons the relay gave them. A
-- 0.2.0 relay that still serves the outbox while the relays are rolled inserts its dead letters
-- without one. A stranger's WAL message it dead-lettered (unsigned_event) was then taken by a
-- bulk redrive, which takes unverified events only by id, and a catch-all route delivered the
-- stranger's content. A trigger gives such a row its kind from the same reasons (0020's), and
-- the rows a 0.2.0 relay inserted since 0020 get theirs here. The rows this version's relays
-- insert carry theirs, and the trigger's WHEN skips them.
-- The kind a relay's reasons say (NULL: another kind). Executable by every role: the trigger runs
-- as the role that inserts (a relay's), and the function reads nothing.
CREATE FUNCTION {schema}.dead_letter_kind_of(p_topic text, p_error text)
RETURNS text LANGUAGE sql IMMUTABLE SET search_path = pg_catalog, pg_temp AS $$
    SELECT CASE
        WHEN p_topic = '(unsigned)'
             AND p_error LIKE 'a WAL message under % whose signature does not verify%' THEN 'unsigned_event'
        WHEN p_error LIKE 'a signed WAL message that is no outbox event:%'
             OR p_error LIKE 'corrupt event row:%' THEN 'corrupt_event'
    END
$$;
CREATE FUNCTION {schema}.dead_letter_kind() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.kind := {schema}.dead_letter_kind_of(NEW.topic::text, NEW.error::text);
    RETURN NEW;
END
$$;
REVOKE EXECUTE ON FUNCTION {schema}.dead_letter_kind() FROM PUBLIC;
CREATE TRIGGER dead_letter_kind BEFORE INSERT ON {schema}.dead_letters
FOR EACH ROW WHEN (NEW.kind IS NULL) EXECUTE FUNCTION {schema}.dead_letter_kind();
UPDATE {schema}.dead_letters SET kind = {schema}.dead_letter_kind_of(topic::text, error::text)
WHERE kind IS NULL AND {schema}.dead_letter_kind_of(topic::text, error::text) IS NOT NULL;
