"""Least privilege: the writer role can only append events; the relay and the console run on
roles of their own."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

from outbox import enqueue, enqueue_many
from outbox.store.migrate import Roles, grant_roles, render_all
from tests.helpers import RelayProcess, count, read_topic, wait_for


class Logins(NamedTuple):
    roles: Roles
    writer_dsn: str
    relay_dsn: str
    console_dsn: str


def _drop_role(conn: psycopg.Connection[Any], role: str) -> None:
    if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone() is None:
        return
    conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(role)))
    conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@pytest.fixture
def logins(pg_dsn: str, schema: str) -> Iterator[Logins]:
    """The three group roles granted on ``schema``, and a login role in each (roles are cluster-wide)."""
    tag = uuid.uuid4().hex[:8]
    roles = Roles(writer=f"w_{tag}", relay=f"r_{tag}", console=f"c_{tag}")
    names = [roles.writer, roles.relay, roles.console, f"app_{tag}", f"relayer_{tag}", f"ops_{tag}"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        grant_roles(conn, schema, roles)
        grant_roles(conn, schema, roles)  # idempotent: a second run changes nothing and fails nothing
        for login, group in ((names[3], roles.writer), (names[4], roles.relay), (names[5], roles.console)):
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                    sql.Identifier(login), sql.Identifier(group)
                )
            )
    try:
        yield Logins(roles, *(make_conninfo(pg_dsn, user=name) for name in names[3:]))
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for role in names:
                _drop_role(conn, role)


DENIED_TO_WRITER = [
    "SELECT * FROM {s}.events",
    "SELECT event_id FROM {s}.events",
    "UPDATE {s}.events SET attempts = 1",
    "DELETE FROM {s}.events",
    "TRUNCATE {s}.events",
    "SELECT * FROM {s}.delivered",
    "SELECT * FROM {s}.dead_letters",
    "INSERT INTO {s}.dead_letters (id, event_id, topic, created_at, attempts, error, first_failed_at, failed_at) "
    "VALUES (1, gen_random_uuid(), 't', now(), 1, 'x', now(), now())",
    "UPDATE {s}.partitions SET owner = NULL",
    "SELECT {s}.ensure_delivered_partitions(3)",
]


@pytest.mark.parametrize("statement", DENIED_TO_WRITER)
def test_writer_role_can_only_insert_events(logins: Logins, schema: str, statement: str) -> None:
    with psycopg.connect(logins.writer_dsn) as conn, pytest.raises(errors.InsufficientPrivilege):
        conn.execute(sql.SQL(statement).format(s=sql.Identifier(schema)))


def test_writer_role_enqueues_every_way(pg_dsn: str, logins: Logins, schema: str) -> None:
    with psycopg.connect(logins.writer_dsn) as conn:
        enqueue(conn, "orders", {"n": 1}, key="k", headers={"h": "v"}, schema=schema)
        enqueue(conn, "orders", b"later", key="k", delay=60, schema=schema)
        enqueue_many(
            conn, [{"topic": "orders", "payload": {"n": i}, "key": "m"} for i in range(50)], schema=schema
        )
        enqueue_many(conn, [{"topic": "orders", "payload": "d", "delay": 5}], schema=schema)  # pipelined path
    assert count(pg_dsn, schema, "events") == 53


def test_relay_runs_under_the_relay_role(
    pg_dsn: str, logins: Logins, schema: str, kafka: str, topic: str
) -> None:
    """Delivery, archive partitions, a retry and a dead letter, all as the relay role."""
    with psycopg.connect(logins.writer_dsn) as conn:
        enqueue_many(
            conn,
            [{"topic": topic, "payload": {"n": i}, "key": f"k{i % 7}"} for i in range(300)],
            schema=schema,
        )
        enqueue(conn, "not a topic!", b"x", key="poison", schema=schema)
    tomorrow = "delivered_p" + (datetime.now(timezone.utc) + timedelta(days=1)).strftime("%Y%m%d")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # the relay role must recreate it
        conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(schema, tomorrow)))
        migrator = conn.execute("SELECT current_user").fetchone()
    env = {"OUTBOX_TEST_FAILURE_RATE": "0.05"}
    with RelayProcess(
        logins.relay_dsn,
        schema,
        kafka,
        "--sink",
        "tests.sinks:flaky",
        "--retry-base",
        "0.05",
        "--retry-cap",
        "0.2",
        "--log-level",
        "info",
        env=env,
    ) as relay:
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="the outbox to drain")
        assert relay.stop() == 0
        out = relay.output()
    assert "permission denied" not in out.lower(), out
    assert count(pg_dsn, schema, "delivered") == 300
    assert count(pg_dsn, schema, "dead_letters", "topic = 'not a topic!'") == 1
    assert count(pg_dsn, schema, "delivered", "attempts > 0") > 0, "no retry was exercised"
    seen = {m.event_id for m in read_topic(kafka, topic, 300)}
    assert len(seen) == 300
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT tableowner FROM pg_tables WHERE schemaname = %s AND tablename = %s", (schema, tomorrow)
        ).fetchone()
    assert row is not None, "the relay role did not recreate the archive partition"
    assert row == migrator  # created through the SECURITY DEFINER function, owned by the migrating role


def test_relay_role_writes_and_reads_the_wal_position(logins: Logins, schema: str) -> None:
    """A WAL batch's position (migration 0014): inserted, the superseded ones deleted, read back."""
    from outbox import capture
    from outbox.store.queries import query

    with psycopg.connect(logins.relay_dsn) as conn:
        for lsn in ("1/100", "1/200"):
            position = {"lsn": lsn, "part_commit": None, "part_events": 0}
            conn.execute(query("wal_positions_superseded", schema), position)
            conn.execute(query("wal_handed_on", schema), position)
            conn.commit()
        assert capture.state(conn, schema).lsn == "1/200"
        # ... and the key WAL messages are signed with, to check them (migration 0015).
        row = conn.execute(query("capture_key", schema)).fetchone()
        assert row is not None and len(bytes(row[0])) == 32
        # ... all of them, since they can be rotated (migration 0021).
        keys = conn.execute(query("capture_keys", schema)).fetchall()
        assert [(bytes(k), r) for k, r in keys] == [(bytes(row[0]), None)]


DENIED_TO_RELAY = [
    # It may insert events (WAL capture puts what it could not deliver into the table), but not
    # switch the capture mode: only migrate does.
    "UPDATE {s}.capture SET mode = 'table'",
    "TRUNCATE {s}.events",
    "DROP TABLE {s}.events",
    "UPDATE {s}.delivered SET attempts = 0",
    "DELETE FROM {s}.delivered",
    "DELETE FROM {s}.dead_letters",
    "CREATE TABLE {s}.mine (x int)",
    "ALTER TABLE {s}.events ADD COLUMN x int",
    # It checks WAL signatures; it cannot make them (the pads) or emit as a writer.
    "SELECT ipad FROM {s}.capture_key",
    "SELECT opad FROM {s}.capture_keys",
    "UPDATE {s}.capture_keys SET retire_at = NULL",
    "SELECT {s}.emit_events(ARRAY['x'::bytea])",
]


@pytest.mark.parametrize("statement", DENIED_TO_RELAY)
def test_relay_role_has_no_more_than_it_needs(logins: Logins, schema: str, statement: str) -> None:
    with psycopg.connect(logins.relay_dsn) as conn, pytest.raises(errors.InsufficientPrivilege):
        conn.execute(sql.SQL(statement).format(s=sql.Identifier(schema)))


def test_roles_cli_print_grant_and_refuse(pg_dsn: str, schema: str) -> None:
    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "outbox", "migrate", "--dsn", pg_dsn, "--schema", schema, *args],
            capture_output=True,
            text=True,
            timeout=60,
        )

    tag = uuid.uuid4().hex[:8]
    printed = cli("--print", "--writer-role", f"w_{tag}", "--relay-role", f"r_{tag}").stdout
    assert printed == render_all(schema, Roles(f"w_{tag}", f"r_{tag}"))
    assert f'ON "{schema}".events TO "w_{tag}"' in printed and "GRANT INSERT (event_id" in printed
    missing = cli("--writer-role", f"w_{tag}", "--relay-role", f"r_{tag}", "--no-create-roles")
    assert missing.returncode != 0
    assert f"--writer-role: 'w_{tag}' does not exist" in missing.stderr
    same = cli("--writer-role", "same", "--relay-role", "same")
    assert same.returncode != 0 and "--relay-role: must differ" in same.stderr
    reserved = cli("--relay-role", "pg_monitor")
    assert reserved.returncode != 0 and "--relay-role: 'pg_monitor' is reserved" in reserved.stderr
    # A hostile name is only ever a quoted identifier: it creates that odd role and nothing else.
    hostile = f'x_{tag}"; DROP SCHEMA {schema} CASCADE; --'
    done = cli("--writer-role", hostile, "--relay-role", f"r_{tag}")
    try:
        assert done.returncode == 0, done.stderr
        with psycopg.connect(pg_dsn) as conn:
            assert conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (hostile,)).fetchone()
            assert conn.execute("SELECT to_regclass(%s)", (f'"{schema}".events',)).fetchone() != (None,)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for role in (hostile, f"r_{tag}"):
                _drop_role(conn, role)


DENIED_TO_CONSOLE = [
    "UPDATE {s}.events SET attempts = 0",
    "DELETE FROM {s}.events",
    "TRUNCATE {s}.events",
    "DELETE FROM {s}.delivered",
    "UPDATE {s}.delivered SET attempts = 0",
    "UPDATE {s}.dead_letters SET error = 'x'",
    "INSERT INTO {s}.dead_letters (id, event_id, topic, created_at, attempts, error, first_failed_at, failed_at) "
    "VALUES (1, gen_random_uuid(), 't', now(), 1, 'x', now(), now())",
    "DELETE FROM {s}.audit",
    "UPDATE {s}.audit SET actor = 'someone else'",
    "UPDATE {s}.partitions SET owner = NULL",
    "DROP TABLE {s}.delivered_default",
    "CREATE TABLE {s}.mine (x int)",
]


@pytest.mark.parametrize("statement", DENIED_TO_CONSOLE)
def test_console_role_has_no_more_than_it_needs(logins: Logins, schema: str, statement: str) -> None:
    with psycopg.connect(logins.console_dsn) as conn, pytest.raises(errors.InsufficientPrivilege):
        conn.execute(sql.SQL(statement).format(s=sql.Identifier(schema)))


def test_console_runs_under_the_console_role(pg_dsn: str, logins: Logins, schema: str) -> None:
    """Every page, redrive and skip through the console, and a replay through the CLI, as a login
    of the console role; the audit trail names that role."""
    from starlette.testclient import TestClient

    from outbox.console import app

    with psycopg.connect(pg_dsn) as conn:
        # Ids as the relay would have taken them: from the events sequence, before what it gives now.
        conn.execute(
            sql.SQL("SELECT setval(pg_get_serial_sequence('{}.events', 'id'), 100)").format(
                sql.Identifier(schema)
            )
        )
        for i, parked in ((1, True), (2, True)):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, attempts, "
                    "error, first_failed_at, failed_at, parked) VALUES (%s, gen_random_uuid(), 'orders', %s, 'p', "
                    "'{{}}', now(), 3, 'boom', now(), now(), %s)"
                ).format(sql.Identifier(schema)),
                (i, f"k{i}".encode(), parked),
            )
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.delivered (id, event_id, topic, key, payload, headers, created_at, delivered_at, "
                "attempts) VALUES (9, gen_random_uuid(), 'orders', 'k9', 'x', '{{}}', now(), now(), 1)"
            ).format(sql.Identifier(schema))
        )
        event_id = conn.execute(
            sql.SQL("SELECT event_id FROM {}.delivered").format(sql.Identifier(schema))
        ).fetchone()[0]
    same = {"sec-fetch-site": "same-origin"}
    with TestClient(app(logins.console_dsn, schema=schema), base_url="http://localhost") as c:
        pages = ("/", "/chart.json", "/dead", "/key?key=k1", f"/event/{event_id}?key=k9", "/audit")
        for path in (*pages, f"/event/{event_id}?archive=scan"):
            assert c.get(path).status_code == 200, path
        for action, ident in (("redrive", "1"), ("skip", "2")):
            form = {"action": action, "hw": "2", "id": ident}
            assert c.post("/dead/preview", data=form, headers=same).status_code == 200
            assert c.post("/dead/act", data=form, headers=same, follow_redirects=False).status_code == 303
    replay = subprocess.run(
        [sys.executable, "-m", "outbox", "replay", "--dsn", logins.console_dsn, "--schema", schema,
         "--since", "1h", "--yes"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert replay.returncode == 0, replay.stderr
    assert count(pg_dsn, schema, "events") == 2  # the redriven dead letter and the replayed event
    assert count(pg_dsn, schema, "dead_letters", "NOT parked") == 1
    with psycopg.connect(pg_dsn) as conn:
        trail = conn.execute(
            sql.SQL("SELECT via, action, db_user, done FROM {}.audit ORDER BY id").format(
                sql.Identifier(schema)
            )
        ).fetchall()
    login = logins.console_dsn.split("user=")[1].split()[0]
    assert trail == [
        ("console", "redrive", login, 1),
        ("console", "skip", login, 1),
        ("cli", "replay", login, 1),
    ]


def test_the_relay_role_verifies_on_its_schedule(pg_dsn: str, logins: Logins, schema: str) -> None:
    """The relay's own verification (--verify-every: migration 0027) reads the archive and the
    repairs and records its run, as the relay role."""
    from outbox.observe.prometheus import Counter, Gauge
    from outbox.sinks.routes import parse_routes
    from outbox.store.outboxes import Outbox
    from outbox.verify.readers import reader_for
    from outbox.verify.schedule import Schedule, Verifier, VerifyMetrics

    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.delivered (id, event_id, topic, payload, headers, created_at, delivered_at, "
                "attempts) VALUES (1, gen_random_uuid(), 'orders', '\\x7b7d', '{{}}', now(), "
                "now() - interval '1 minute', 1)"
            ).format(sql.Identifier(schema))
        )
    metrics = VerifyMetrics(Gauge("m", "m", ["outbox", "topic", "sink"]), Counter("c", "c", ["outbox"]))
    verifier = Verifier(
        lambda: [],
        parse_routes(["*=amqp://127.0.0.1:1/"], None),
        reader_for,
        metrics,
        Schedule(60.0, sample=1),
    )
    report = verifier.run_once(Outbox("default", logins.relay_dsn, schema))
    assert report is not None and report.counts["unverifiable"] == 1
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT via, checked FROM {}.verifications").format(sql.Identifier(schema))
        )
        assert row.fetchall() == [("relay", 1)]
