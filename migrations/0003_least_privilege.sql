-- outbox 0003: let a relay run without owning the tables.
--
-- Creating a day partition of `delivered` needs ownership of the parent table.
-- The function that does it now runs with its owner's rights (the role that ran
-- the migrations), so a relay role needs only EXECUTE on it, not CREATE on the
-- schema or ownership. Its search_path is pinned and every name in it is
-- schema-qualified, so a caller cannot redirect what it touches.
ALTER FUNCTION {schema}.ensure_delivered_partitions(integer)
    SECURITY DEFINER SET search_path = pg_catalog, pg_temp;
REVOKE EXECUTE ON FUNCTION {schema}.ensure_delivered_partitions(integer) FROM PUBLIC;
