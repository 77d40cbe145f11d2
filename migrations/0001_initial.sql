-- outbox 0001: the hot events table, the partitioned archive, dead letters.
--
-- Placeholders: {schema} is the schema as an identifier, {schema_name} the same
-- name as a string literal, {channel} the NOTIFY channel as a literal. Literal
-- braces are doubled ({{}}), because the file goes through psycopg.sql.SQL.format.

-- Pending events. Kept small: a row lives here from commit until the broker acks
-- it, then it is deleted (moved to the archive), never updated in place on the
-- happy path. Only a failed attempt updates a row (attempts/available_at/last_error).
CREATE TABLE {schema}.events (
    id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id        uuid        NOT NULL,
    topic           text        NOT NULL,
    key             bytea,
    payload         bytea       NOT NULL,
    -- header name -> string, or {{"b64": "..."}} for a value that is not UTF-8 text
    headers         jsonb       NOT NULL DEFAULT '{{}}',
    created_at      timestamptz NOT NULL DEFAULT clock_timestamp(),
    available_at    timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    first_failed_at timestamptz
) WITH (
    -- Every row is deleted within milliseconds of its insert: vacuum by count,
    -- not by a fraction of a table whose size swings between 0 and millions.
    autovacuum_vacuum_scale_factor = 0.0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0.0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0.0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);

-- Per-key order: an event may be claimed only if no earlier event of its key has
-- failed and is waiting for its retry. Failed rows are few, so this partial
-- index stays tiny and costs the writer nothing (attempts = 0 on insert).
CREATE INDEX events_retrying_key_idx ON {schema}.events (key, id) WHERE attempts > 0;

-- Archive of delivered events, partitioned by delivery day (UTC) so retention is
-- DROP TABLE, not a DELETE storm. No index: it is written at relay speed and read
-- by replay/status, which scan one or a few day partitions.
CREATE TABLE {schema}.delivered (
    id             bigint      NOT NULL,
    event_id       uuid        NOT NULL,
    topic          text        NOT NULL,
    key            bytea,
    payload        bytea       NOT NULL,
    headers        jsonb       NOT NULL,
    created_at     timestamptz NOT NULL,
    delivered_at   timestamptz NOT NULL DEFAULT now(),
    attempts       integer     NOT NULL,
    sink_partition integer,
    sink_offset    bigint
) PARTITION BY RANGE (delivered_at);

-- Safety net: if the relay could not create a day partition in time, rows land
-- here instead of failing the ack. ensure_delivered_partitions keeps it empty.
CREATE TABLE {schema}.delivered_default PARTITION OF {schema}.delivered DEFAULT;

-- Every function here pins its search_path: it resolves names in pg_catalog whoever calls it.
CREATE FUNCTION {schema}.ensure_delivered_partitions(days_ahead integer DEFAULT 3)
RETURNS integer LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    d date;
    pname text;
    created integer := 0;
BEGIN
    -- Serialise concurrent relays creating the same partition.
    PERFORM pg_advisory_xact_lock(hashtext({schema_name} || '.delivered'));
    FOR d IN
        SELECT generate_series((now() AT TIME ZONE 'UTC')::date - 1,
                               (now() AT TIME ZONE 'UTC')::date + days_ahead,
                               interval '1 day')::date
    LOOP
        pname := 'delivered_p' || to_char(d, 'YYYYMMDD');
        IF to_regclass(format('%I.%I', {schema_name}, pname)) IS NULL THEN
            EXECUTE format(
                'CREATE TABLE %I.%I PARTITION OF %I.delivered FOR VALUES FROM (%L) TO (%L)',
                {schema_name}, pname, {schema_name},
                d::timestamp AT TIME ZONE 'UTC', (d + 1)::timestamp AT TIME ZONE 'UTC');
            created := created + 1;
        END IF;
    END LOOP;
    RETURN created;
END
$$;

SELECT {schema}.ensure_delivered_partitions();

-- Events that can never be delivered, with the reason. The original id is kept
-- so that a redrive puts the event back at the head of its key.
CREATE TABLE {schema}.dead_letters (
    id              bigint      PRIMARY KEY,
    event_id        uuid        NOT NULL,
    topic           text        NOT NULL,
    key             bytea,
    payload         bytea,
    headers         jsonb,
    created_at      timestamptz NOT NULL,
    attempts        integer     NOT NULL,
    error           text        NOT NULL,
    first_failed_at timestamptz NOT NULL,
    failed_at       timestamptz NOT NULL
);

-- Wake the relay on commit. One notification per inserting statement (not per
-- row), and PostgreSQL folds duplicates within a transaction. NOTIFY takes a
-- global lock at commit, so `outbox notify off` disables this trigger for very
-- high write rates; the relay's jittered poll keeps it correct without it.
CREATE FUNCTION {schema}.notify_events() RETURNS trigger LANGUAGE plpgsql
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    PERFORM pg_notify({channel}, '');
    RETURN NULL;
END
$$;

CREATE TRIGGER events_notify AFTER INSERT ON {schema}.events
    FOR EACH STATEMENT EXECUTE FUNCTION {schema}.notify_events();
