"""PostgreSQL's own seams, mounted as a role that may only CREATE in the database would: overloads
in a schema named after the migrator's or the relay's login (first on their default
search_path), and the shared ``outbox_fleet`` made before the project makes it. Each attack ran
code as the migrator (a superuser) or the relay (which reads the WAL signing key) before the fix.
tests/acceptance/test_search_path_traps.py plants overloads of every call, for every command."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox.store import pinning
from outbox.store.migrate import Roles, grant_roles, migrate
from tests.helpers import FAST, ModuleProcess, count, read_topic, wait_for


@dataclass
class Database:
    """A database of this test's own, and a role that may only CREATE in it (the attacker)."""

    dsn: str
    attacker: str

    def as_attacker(self) -> psycopg.Connection[psycopg.rows.TupleRow]:
        return psycopg.connect(make_conninfo(self.dsn, user=self.attacker), autocommit=True)

    def calls(self) -> int:
        """Calls the attacker's functions took (a sequence: a rolled-back call counts too)."""
        with pinning.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("SELECT last_value, is_called FROM loot.calls").fetchone()
            assert row is not None
            return int(row[0]) if row[1] else 0


@pytest.fixture
def database(pg_dsn: str) -> Iterator[Database]:
    name = f"seams_{uuid.uuid4().hex[:10]}"
    attacker = f"creator_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(attacker)))
        conn.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                sql.Identifier(name), sql.Identifier(attacker)
            )
        )
    db = Database(make_conninfo(pg_dsn, dbname=name), attacker)
    with db.as_attacker() as conn:  # where the planted functions count their calls and keep what they took
        conn.execute("CREATE SCHEMA loot")
        conn.execute("GRANT USAGE ON SCHEMA loot TO PUBLIC")
        conn.execute("CREATE SEQUENCE loot.calls")
        conn.execute("GRANT USAGE, UPDATE ON SEQUENCE loot.calls TO PUBLIC")
        conn.execute("CREATE TABLE loot.taken (what bytea)")
        conn.execute("GRANT INSERT ON loot.taken TO PUBLIC")
    try:
        yield db
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(attacker)))


def test_migrate_runs_no_function_a_create_only_role_planted_for_the_migrator(database: Database) -> None:
    """A schema named after the migrator's login is first on its default search_path. There, an
    exact-type to_char(date, text) and generate_series(date, date, interval) beat pg_catalog's
    (which take timestamps) in ensure_delivered_partitions, which 0001 calls: as a superuser."""
    migrator = conninfo_to_dict(database.dsn).get("user") or "root"
    with database.as_attacker() as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(migrator)))
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO PUBLIC").format(sql.Identifier(migrator)))
        s = sql.Identifier(migrator)
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {}.to_char(date, text) RETURNS text LANGUAGE sql AS "
                "$$ SELECT nextval('loot.calls'); SELECT pg_catalog.to_char($1::timestamp, $2) $$"
            ).format(s)
        )
        conn.execute(
            sql.SQL(
                "CREATE FUNCTION {}.generate_series(date, date, interval) RETURNS SETOF timestamp LANGUAGE sql "
                "AS $$ SELECT nextval('loot.calls'); SELECT * FROM pg_catalog.generate_series($1::timestamp, "
                "$2::timestamp, $3) $$"
            ).format(s)
        )
    with psycopg.connect(database.dsn, autocommit=True) as conn:  # the trap is real: it fires unpinned
        conn.execute("SELECT to_char(current_date, 'YYYY')")
    assert database.calls() == 1
    run = subprocess.run(
        [sys.executable, "-m", "outbox", "migrate", "--dsn", database.dsn, "--schema", "victim", "--roles"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert database.calls() == 1, "migrate called the planted functions"
    with psycopg.connect(database.dsn, autocommit=True) as conn:  # and the relay's hourly call
        conn.execute("SELECT victim.ensure_delivered_partitions(5)")
        for function in ("ensure_delivered_partitions(integer)", "notify_events()"):
            row = conn.execute(
                "SELECT proconfig FROM pg_proc WHERE oid = %s::regprocedure", (f"victim.{function}",)
            ).fetchone()
            assert row == (["search_path=pg_catalog, pg_temp"],), (function, row)
    assert database.calls() == 1, "the partition function called the planted functions"


def test_the_relay_runs_no_function_planted_for_its_role_and_the_signing_key_stays_unread(
    database: Database, kafka: str, topic: str, wal_dsn: str, pg_dsn: str
) -> None:
    """A schema named after the relay's login, with pg_try_advisory_xact_lock(integer, smallint)
    and its _shared twin: the claim and ownership SQL pass a smallint partition, so these beat
    pg_catalog's (integer, integer), and run as the relay, which may read the WAL signing key. Here
    they copy it out. The relay, serving a table outbox and a WAL capture one, never calls them."""
    if wal_dsn != pg_dsn:
        pytest.skip("the machine's server is not in wal_level = logical (the matrix's is)")
    tag = uuid.uuid4().hex[:8]
    roles = Roles(writer=f"w_{tag}", relay=f"r_{tag}", console=f"c_{tag}")
    login = f"relay_{tag}"
    from outbox import capture

    with psycopg.connect(database.dsn, autocommit=True) as conn:
        for schema in ("victim", "victim_wal"):
            migrate(conn, schema)
            grant_roles(conn, schema, roles)
        capture.switch(conn, "victim_wal", "wal")
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN REPLICATION IN ROLE {}").format(
            sql.Identifier(login), sql.Identifier(roles.relay)
        ))  # fmt: skip
    try:
        with database.as_attacker() as conn:
            s = sql.Identifier(login)
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(s))
            conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO PUBLIC").format(s))
            for variant in ("", "_shared"):
                conn.execute(
                    sql.SQL(
                        "CREATE FUNCTION {}.{}(integer, smallint) RETURNS boolean LANGUAGE plpgsql AS $$ "
                        "BEGIN PERFORM nextval('loot.calls'); "
                        "BEGIN INSERT INTO loot.taken SELECT key FROM victim_wal.capture_key; "
                        "EXCEPTION WHEN OTHERS THEN NULL; END; "
                        "RETURN pg_catalog.{}($1, $2::integer); END $$"
                    ).format(
                        s,
                        sql.Identifier("pg_try_advisory_xact_lock" + variant),
                        sql.Identifier("pg_try_advisory_xact_lock" + variant),
                    )
                )
        relay_dsn = make_conninfo(database.dsn, user=login)
        with psycopg.connect(
            relay_dsn, autocommit=True
        ) as conn:  # the trap is real: unpinned, it takes the key
            conn.execute("SELECT pg_try_advisory_xact_lock(1::integer, 1::smallint)")
        assert database.calls() == 1 and count(database.dsn, "loot", "taken") == 1
        with pinning.connect(database.dsn, autocommit=True) as conn:
            conn.execute("TRUNCATE loot.taken")
            with conn.transaction():
                for schema in ("victim", "victim_wal"):
                    for i in range(20):
                        outbox.enqueue(conn, topic, {"i": i}, key=f"k{i % 4}", schema=schema)
        outboxes = ("--outbox", f"t={relay_dsn}#victim", "--outbox", f"w={relay_dsn}#victim_wal")
        with ModuleProcess("outbox", "relay", *outboxes, "--kafka-bootstrap", kafka, *FAST) as relay:
            wait_for(
                lambda: (
                    count(database.dsn, "victim", "delivered") == 20
                    and count(database.dsn, "victim_wal", "delivered") == 20
                ),
                timeout=60,
                what=f"both outboxes delivered\n{relay.output()[-3000:]}",
            )
            assert relay.stop() == 0, relay.output()[-3000:]
        assert len(read_topic(kafka, topic, 40)) >= 40
        assert database.calls() == 1, "the relay called the planted functions"
        assert count(database.dsn, "loot", "taken") == 0, "the WAL signing key was copied out"
    finally:
        with psycopg.connect(database.dsn, autocommit=True) as conn:
            for role in (login, roles.writer, roles.relay, roles.console):
                conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _migrate(dsn: str, schema: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", "migrate", "--dsn", dsn, "--schema", schema],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_migrate_adopts_no_outbox_fleet_a_create_only_role_made_first_or_may_create_in(
    database: Database,
) -> None:
    """A role that may only CREATE makes ``outbox_fleet`` before the project does. Migration 0018
    created its tables only when missing, so they went into the attacker's schema, where it could
    add a trigger that runs as every relay. migrate refuses, in one line, and creates nothing;
    so it does for a trusted schema in which another role may create."""
    with database.as_attacker() as conn:
        conn.execute("CREATE SCHEMA outbox_fleet")
    run = _migrate(database.dsn, "victim")
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    assert (
        "the relays' membership schema 'outbox_fleet' is not trusted: the schema itself is owned by "
        f"{database.attacker}" in run.stderr
    ), run.stderr
    with pinning.connect(database.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT to_regnamespace('victim')").fetchone() == (None,)
        assert conn.execute(
            "SELECT count(*) FROM pg_class WHERE relnamespace = 'outbox_fleet'::regnamespace"
        ).fetchone() == (0,)
        conn.execute("DROP SCHEMA outbox_fleet")
    assert _migrate(database.dsn, "victim").returncode == 0  # gone: the project's own is made
    with pinning.connect(database.dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("GRANT CREATE ON SCHEMA outbox_fleet TO {}").format(sql.Identifier(database.attacker))
        )
    run = _migrate(database.dsn, "victim_2")
    assert run.returncode == 2 and f"{database.attacker} may create objects in it" in run.stderr, run.stderr


def test_an_outbox_named_on_the_command_line_is_checked_as_a_found_one(
    database: Database, kafka: str
) -> None:
    """A schema named with --schema (or --outbox) whose owner is not trusted, or in which another
    role may create, could run code as the relay exactly like a discovered one: refused, one line."""
    with pinning.connect(database.dsn, autocommit=True) as conn:
        migrate(conn, "trusted")  # outbox_fleet: the project's
    with database.as_attacker() as conn:
        migrate(conn, "owned")
    for schema, why in (("owned", f"the schema itself is owned by {database.attacker}"),):
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "outbox",
                "relay",
                "--dsn",
                database.dsn,
                "--schema",
                schema,
                "--kafka-bootstrap",
                kafka,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
        assert f"schema: '{schema}' is not trusted: {why}" in run.stderr, run.stderr
    status = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--dsn", database.dsn, "--schema", "owned"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode != 0 and "is not trusted" in status.stdout + status.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--dsn", database.dsn, "--schema", "trusted"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0, ok.stderr


def test_the_grants_audit_names_every_role_that_may_create_where_sessions_resolve_names(
    database: Database,
) -> None:
    """``outbox migrate --check-grants`` migrates nothing; it lists the roles outside the trusted
    ones that may CREATE in the database, in public, in an outbox's schema or in outbox_fleet, or
    own a schema named after another role, saying what each could do; exit 1 when there is one."""
    with pinning.connect(database.dsn, autocommit=True) as conn:
        migrate(conn, "victim")
        grant_roles(conn, "victim", Roles(writer=f"w_{database.attacker}", relay=f"r_{database.attacker}",
                                          console=f"c_{database.attacker}"))  # fmt: skip
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")  # as PostgreSQL 15+ has it

    def audit() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "outbox",
                "migrate",
                "--dsn",
                database.dsn,
                "--schema",
                "victim",
                "--check-grants",
                "--relay-role",  # the role granted the signing key: it may read it
                f"r_{database.attacker}",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )

    run = audit()  # the attacker may create schemas (the fixture's grant): that alone
    assert run.returncode == 1, run.stderr
    assert run.stdout.splitlines() == [
        f"role {database.attacker} may CREATE in database {conninfo_to_dict(database.dsn)['dbname']}: it can make a "
        'schema named after another role (first on that role\'s default search_path, "$user"), there plant '
        "overloads that beat pg_catalog's, or make outbox_fleet before the project does"
    ], run.stdout
    with pinning.connect(database.dsn, autocommit=True) as conn:
        conn.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")  # as PostgreSQL 14 and older have it
        conn.execute(
            sql.SQL("GRANT CREATE ON SCHEMA victim, outbox_fleet TO {}").format(
                sql.Identifier(database.attacker)
            )
        )
    with database.as_attacker() as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(f"r_{database.attacker}")))
    lines = audit().stdout.splitlines()
    assert len(lines) == 5, lines
    assert any(line.startswith("PUBLIC (every role) may CREATE in schema public") for line in lines), lines
    assert any(line.startswith(f"role {database.attacker} may CREATE in outbox_fleet") for line in lines)
    assert any(
        line.startswith(f"role {database.attacker} may CREATE in the outbox schema victim") for line in lines
    )
    assert any(line.startswith(f"role {database.attacker} owns schema r_{database.attacker}, named after another role")
               for line in lines)  # fmt: skip
    with pinning.connect(database.dsn, autocommit=True) as conn:
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
        conn.execute(
            sql.SQL("REVOKE CREATE ON SCHEMA victim, outbox_fleet FROM {}").format(
                sql.Identifier(database.attacker)
            )
        )
        conn.execute(sql.SQL("DROP SCHEMA {}").format(sql.Identifier(f"r_{database.attacker}")))
        conn.execute(sql.SQL("REVOKE CREATE ON DATABASE {} FROM {}").format(
            sql.Identifier(conninfo_to_dict(database.dsn)["dbname"]), sql.Identifier(database.attacker)
        ))  # fmt: skip
    clean = audit()
    assert clean.returncode == 0 and "no role outside the trusted ones" in clean.stdout, clean.stdout
    with pinning.connect(database.dsn, autocommit=True) as conn:
        for kind in ("w", "r", "c"):
            conn.execute(
                sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(f"{kind}_{database.attacker}"))
            )
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(f"{kind}_{database.attacker}")))
