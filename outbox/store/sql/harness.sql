-- Named queries of the load harness shared by `outbox demo`, `outbox bench` and
-- `outbox bench faults` (outbox.harness). Same rules as the product's queries.

-- name: harness_orders_table
-- The business table the sample app writes an order into, next to its event.
CREATE TABLE IF NOT EXISTS {schema}.orders (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    key        text NOT NULL,
    seq        integer NOT NULL,
    amount     integer NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
)

-- name: harness_insert_order
-- One business row: the order of a key, with the key's sequence number.
INSERT INTO {schema}.orders (key, seq, amount) VALUES (%s, %s, %s)

-- name: harness_create_database
-- `outbox dev`: the quickstart's database, on the embedded server.
CREATE DATABASE {database}

-- name: harness_set_password
-- The embedded PostgreSQL's superuser gets a password of its own (generated for each server);
-- connections then need it: scram-sha-256 (harness.embedded writes pg_hba.conf).
ALTER ROLE CURRENT_USER PASSWORD {password}

-- name: harness_hba_file
-- Where the embedded server reads its client authentication rules.
SELECT current_setting('hba_file')
