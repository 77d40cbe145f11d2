"""A tenant who owns its schema (or may create in it, or add triggers to its tables) is not
trusted: ``outbox relay --schemas`` must not serve that schema, since the relay would run the
tenant's code with its own rights. Mounted on the real PostgreSQL with a real relay process."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox.store.migrate import migrate
from tests.helpers import FAST, ModuleProcess, count, wait_for


@pytest.fixture
def tenant(pg_dsn: str) -> Iterator[str]:
    """A login role that may create schemas in the database (a DSN to it), dropped after."""
    name = f"tenant_{uuid.uuid4().hex[:8]}"
    dbname = conninfo_to_dict(pg_dsn)["dbname"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        conn.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(dbname), sql.Identifier(name))
        )
    yield make_conninfo(pg_dsn, user=name)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(name)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def _superuser(dsn: str, role: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
    return bool(row and row[0])


def test_a_schema_a_tenant_controls_is_not_served_and_its_code_never_runs(
    pg_dsn: str, tenant: str, prefix: str, kafka: str, topic: str
) -> None:
    role = conninfo_to_dict(tenant)["user"]
    trusted, owned, creatable, triggerable = (f"{prefix}_{n}" for n in ("ok", "owned", "create", "trigger"))
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # the operator's first (outbox_fleet)
        migrate(conn, trusted)
    # The tenant migrates an outbox of its own, then makes the partition function (which every
    # relay calls) run as its caller and make the tenant a superuser.
    with psycopg.connect(tenant, autocommit=True) as conn:
        migrate(conn, owned)
        conn.execute(
            sql.SQL(
                "CREATE OR REPLACE FUNCTION {s}.ensure_delivered_partitions(days_ahead integer DEFAULT 3) "
                "RETURNS integer LANGUAGE plpgsql SECURITY INVOKER AS "
                "$$ BEGIN EXECUTE format('ALTER ROLE %I SUPERUSER', {r}); RETURN 0; END $$"
            ).format(s=sql.Identifier(owned), r=sql.Literal(role))
        )
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for schema in (creatable, triggerable):
            migrate(conn, schema)
        conn.execute(
            sql.SQL("GRANT CREATE ON SCHEMA {} TO {}").format(sql.Identifier(creatable), sql.Identifier(role))
        )
        conn.execute(
            sql.SQL("GRANT TRIGGER ON {}.events TO {}").format(
                sql.Identifier(triggerable), sql.Identifier(role)
            )
        )
    with psycopg.connect(pg_dsn) as conn:
        for schema in (trusted, owned, creatable, triggerable):
            outbox.enqueue(conn, topic, schema.encode(), key="k", schema=schema)
    relay = ModuleProcess(
        "outbox", "relay", "--dsn", pg_dsn, "--schemas", f"{prefix}_*", "--discover-every", "1",
        "--kafka-bootstrap", kafka, *FAST,
    )  # fmt: skip
    try:
        wait_for(lambda: count(pg_dsn, trusted, "delivered") == 1, timeout=60, what="the trusted tenant")
        wait_for(
            lambda: relay.output().count("is not trusted") >= 3 or _superuser(pg_dsn, role),
            timeout=30,
            what="the refusals",
        )
        assert not _superuser(pg_dsn, role), "the tenant's function ran as the relay"
        assert relay.stop() == 0
        log = relay.output()
    finally:
        relay.close()
    for schema, why in (
        (owned, f"the schema itself is owned by {role}"),
        (creatable, f"{role} may create objects in it"),
        (triggerable, f"{role} may add triggers to events"),
    ):
        assert log.count(f"{schema} is not served: schema: '{schema}' is not trusted: {why}") == 1, log[
            -3000:
        ]
        assert count(pg_dsn, schema, "delivered") == 0 and count(pg_dsn, schema, "events") == 1
    status = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--dsn", pg_dsn, "--schemas", f"{prefix}_*", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    rows: dict[str, Any] = {r["name"]: r for r in json.loads(status.stdout)["outboxes"]}
    assert status.returncode == 1, status.stderr
    assert "is not trusted" in rows[owned]["error"] and "error" not in rows[trusted], rows


def test_a_membership_schema_a_tenant_owns_is_refused_and_its_code_never_runs(
    pg_dsn: str, kafka: str, topic: str
) -> None:
    """The relays' membership (outbox_fleet) is shared by every outbox of a database, and every
    claim and heartbeat touches it. Where a tenant owns it (a tenant who migrated first, before
    migrate refused to adopt its schema: tests/acceptance/test_postgres_seams.py), it could put a
    trigger there that runs as the relay. A relay serves no outbox of that database, found by a
    glob or named, and says why; migrate adds nothing to it."""
    database = f"outbox_fleet_{uuid.uuid4().hex[:8]}"
    role = f"tenant_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(database), sql.Identifier(role)
            )
        )
    dsn = make_conninfo(pg_dsn, dbname=database)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, "tenant_ok")
            with conn.transaction():
                outbox.enqueue(conn, topic, b"x", key="k", schema="tenant_ok")
            # As an install made before this version may have it: the tenant owns the schema.
            for what in ("SCHEMA outbox_fleet", "TABLE outbox_fleet.relays"):
                conn.execute(sql.SQL("ALTER " + what + " OWNER TO {}").format(sql.Identifier(role)))
        with psycopg.connect(make_conninfo(dsn, user=role), autocommit=True) as conn:
            migrate(conn, "tenant_own")
            conn.execute(
                sql.SQL(
                    "CREATE FUNCTION outbox_fleet.grab() RETURNS trigger LANGUAGE plpgsql AS "
                    "$$ BEGIN EXECUTE format('ALTER ROLE %I SUPERUSER', {r}); RETURN NEW; END $$"
                ).format(r=sql.Literal(role))
            )
            conn.execute(
                "CREATE TRIGGER grab BEFORE INSERT OR UPDATE ON outbox_fleet.relays "
                "FOR EACH ROW EXECUTE FUNCTION outbox_fleet.grab()"
            )
        relay = ModuleProcess(
            "outbox", "relay", "--dsn", dsn, "--schemas", "tenant_*", "--kafka-bootstrap", kafka, *FAST,
        )  # fmt: skip
        try:
            wait_for(lambda: relay.output().count("is not trusted") >= 2, timeout=30, what="the refusals")
            assert relay.stop() == 0
            log = relay.output()
        finally:
            relay.close()
        assert log.count("the relays' membership schema 'outbox_fleet' is not trusted") == 2, log[-3000:]
        assert f"is owned by {role}" in log
        # Named, the one outbox: refused at start, in one line.
        run = subprocess.run(
            [sys.executable, "-m", "outbox", "relay", "--dsn", dsn, "--schema", "tenant_ok", "--kafka-bootstrap", kafka],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert "membership schema 'outbox_fleet' is not trusted" in run.stderr, run.stderr
        # Named in a list: not served, saying why (the list may change on SIGHUP: it runs on).
        with ModuleProcess(
            "outbox", "relay", "--outbox", f"ok={dsn}#tenant_ok", "--kafka-bootstrap", kafka
        ) as named:
            wait_for(lambda: "ok is not served: schema: the relays' membership" in named.output(), timeout=30)
        assert not _superuser(pg_dsn, role), "the tenant's trigger ran as the relay"
        assert count(dsn, "tenant_ok", "events") == 1 and count(dsn, "tenant_ok", "delivered") == 0
        run = subprocess.run(
            [sys.executable, "-m", "outbox", "migrate", "--dsn", dsn, "--schema", "tenant_new"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert f"'outbox_fleet' is not trusted: the schema itself is owned by {role}" in run.stderr
        with psycopg.connect(dsn) as conn:
            assert conn.execute("SELECT to_regnamespace('tenant_new')").fetchone() == (None,)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(database)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
