-- outbox 0019: every function of the outbox resolves names in pg_catalog, whoever calls it (issue 56).
--
-- A plain function looks names up along its caller's search_path, by default "$user", public,
-- after pg_catalog. A role that may only CREATE in the database can make a schema named after
-- another role, and on PostgreSQL 14 and older every login role may create in public: there, an
-- overload that matches a call more exactly than pg_catalog's (to_char(date, text),
-- generate_series(date, date, interval)) is the one called, with the caller's rights. The
-- archive's partition function was pinned by 0003, after 0001 had already called it once as the
-- migrator; the NOTIFY trigger's function ran on every writer's session unpinned. 0001 now
-- creates both pinned (a new install is safe from its first statement); this pins them where 0001
-- ran before. The other functions (0015, 0017, 0018) were created pinned.
ALTER FUNCTION {schema}.ensure_delivered_partitions(integer) SET search_path = pg_catalog, pg_temp;
ALTER FUNCTION {schema}.notify_events() SET search_path = pg_catalog, pg_temp;
