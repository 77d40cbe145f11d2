"""PostgreSQL's own seams, for good: overloads of every pg_catalog function and operator the
project's SQL calls (tests/traps.py, derived from the SQL) are planted where a role that may only
CREATE could put them, in the ``"$user"`` schema of each login role and in ``public`` (which
every role may create in on PostgreSQL 14 and older, as here). Then the project does everything it
does: ``migrate`` (with --roles, --capture wal, --schemas), every CLI command, the console's pages
and actions, every writer stack and the inbox, the relay over table and WAL capture. No trap may
fire: each would have run an attacker's code as the migrator (a superuser), the relay (which reads
the WAL signing key), the console or the application."""

from __future__ import annotations

import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox.cli import main
from outbox.harness.embedded import free_port
from outbox.sinks import claim_check
from outbox.store import pinning
from tests import traps
from tests.helpers import FAST, ModuleProcess, count, http_get, wait_for


@dataclass(frozen=True)
class Cast:
    """The roles of one trapped run: the outbox's three groups, a login in each, the attacker."""

    tag: str
    migrator: str  # the suite's own login (a superuser): runs migrate and the CLI

    @property
    def attacker(self) -> str:
        return f"trap_attacker_{self.tag}"

    def group(self, kind: str) -> str:
        return f"trap_{kind}_{self.tag}"

    def login(self, kind: str) -> str:
        return f"trap_{kind}_login_{self.tag}"

    @property
    def logins(self) -> list[str]:
        return [self.migrator, *(self.login(k) for k in ("writer", "relay", "console"))]

    def roles_options(self) -> list[str]:
        return [
            *("--writer-role", self.group("writer"), "--relay-role", self.group("relay")),
            *("--console-role", self.group("console")),
        ]


@pytest.fixture(scope="session")
def trap_template(pg_dsn: str) -> Iterator[tuple[str, Cast]]:
    """A database with every trap planted, to clone (its name), and the roles (this worker's)."""
    tag = uuid.uuid4().hex[:8]
    cast = Cast(tag, conninfo_to_dict(pg_dsn).get("user") or "root")
    template = f"trap_template_{tag}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(cast.attacker)))
        for kind in ("writer", "relay", "console"):
            conn.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(cast.group(kind))))
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN {} IN ROLE {}").format(
                    sql.Identifier(cast.login(kind)),
                    sql.SQL("REPLICATION" if kind == "relay" else ""),
                    sql.Identifier(cast.group(kind)),
                )
            )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(template)))
    with psycopg.connect(make_conninfo(pg_dsn, dbname=template)) as conn:
        # As PostgreSQL 14 and older have it: every role may create in public.
        conn.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        conn.execute(sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
            sql.Identifier(template), sql.Identifier(cast.attacker)
        ))  # fmt: skip
        traps.plant(conn, [*cast.logins, "public"], cast.attacker)
        conn.commit()
    yield template, cast
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(template)))
        for role in [
            *(cast.login(k) for k in ("writer", "relay", "console")),
            *(cast.group(k) for k in ("writer", "relay", "console")),
            cast.attacker,
        ]:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@dataclass
class Trapped:
    dsn: str  # the migrator's (the suite's superuser)
    cast: Cast
    wal: bool  # the server can do WAL capture (wal_level = logical, 14+)

    def as_login(self, kind: str) -> str:
        return make_conninfo(self.dsn, user=self.cast.login(kind))

    def fired(self) -> dict[str, int]:
        with pinning.connect(self.dsn, autocommit=True) as conn:
            return traps.fired(conn)


@pytest.fixture
def trapped(pg_dsn: str, trap_template: tuple[str, Cast]) -> Iterator[Trapped]:
    """A fresh clone of the trapped database, as this test's own."""
    template, cast = trap_template
    name = f"trap_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template))
        )
        level, version = conn.execute(
            "SELECT pg_catalog.current_setting('wal_level'), pg_catalog.current_setting('server_version_num')::int"
        ).fetchone() or ("", 0)
    dsn = make_conninfo(pg_dsn, dbname=name)
    try:
        yield Trapped(dsn, cast, level == "logical" and int(version) >= 140000)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for (slot,) in conn.execute(
                "SELECT slot_name FROM pg_catalog.pg_replication_slots WHERE database = %s", (name,)
            ).fetchall():
                conn.execute("SELECT pg_catalog.pg_drop_replication_slot(%s)", (slot,))
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _cli(*argv: str) -> None:
    assert main(list(argv)) == 0, argv


def _migrate(t: Trapped) -> list[str]:
    """Every way migrate runs: the outbox with --roles, one in WAL capture, tenants by --schemas.
    Returns the outboxes' schemas."""
    roles = t.cast.roles_options()
    _cli("migrate", "--dsn", t.dsn, "--schema", "victim", *roles)
    schemas = ["victim"]
    if t.wal:
        _cli("migrate", "--dsn", t.dsn, "--schema", "victim_wal", *roles, "--capture", "wal")
        schemas.append("victim_wal")
    with pinning.connect(t.dsn, autocommit=True) as conn:
        for tenant in ("tenant_a", "tenant_b"):
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(tenant)))
    _cli("migrate", "--dsn", t.dsn, "--schemas", "tenant_*", *roles)
    return schemas


def _seed(t: Trapped, schema: str) -> dict[str, Any]:
    """Events, an archived event and dead letters for the commands to act on, written directly."""
    with pinning.connect(t.dsn) as conn:
        s = sql.Identifier(schema)
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.delivered (id, event_id, topic, key, payload, headers, created_at, attempts) "
                "VALUES (1000, gen_random_uuid(), 'orders.placed', 'k1', '{{}}', '{{}}', now(), 1)"
            ).format(s)
        )
        for i, parked in ((2000, True), (2001, False), (2002, True)):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, "
                    "attempts, error, first_failed_at, failed_at, parked) VALUES (%s, gen_random_uuid(), "
                    "'lost.x', %s, '{{}}', '{{}}', now(), 3, 'no route for topic', now(), now(), %s)"
                ).format(s),
                (i, f"d{i}".encode(), parked),
            )
        row = conn.execute(sql.SQL("SELECT event_id::text FROM {}.delivered").format(s)).fetchone()
        conn.commit()
    assert row is not None
    return {"archived": row[0]}


def test_migrate_every_cli_command_and_the_console_fire_no_trap(trapped: Trapped) -> None:
    t = trapped
    schemas = _migrate(t)
    _cli("migrate", "--dsn", t.dsn, "--schema", "victim")  # again: nothing to apply, roles kept
    seeded = _seed(t, "victim")
    base = ("--dsn", t.dsn, "--schema", "victim")
    for argv in (
        ("status", *base),
        ("status", *base, "--json"),
        ("status", "--dsn", t.dsn, "--schemas", "tenant_*", "--json"),
        ("notify", *base, "off"),
        ("notify", *base, "on"),
        ("dead", "list", *base, "--all"),
        ("dead", "skip", *base, "--ids", "2002", "--yes"),
        ("dead", "redrive", *base, "--ids", "2000", "--yes"),
        ("retry", *base, "--all", "--yes"),
        ("replay", *base, "--since", "1h", "--yes"),
        ("purge", *base, "--older-than", "30d", "--yes"),
        ("verify", *base, "--since", "1h", "--route", "*=amqp://127.0.0.1:1/", "--repair"),
        ("audit", *base),
        ("inbox", "prune", *base, "--older-than", "7d"),
    ):
        _cli(*argv)
    assert main(["migrate", "--dsn", t.dsn, "--schema", "victim", "--check-grants"]) == 1  # the attacker's
    if t.wal:
        _cli("status", "--dsn", t.dsn, "--schema", "victim_wal")
        _cli("capture", "rotate-key", "--dsn", t.dsn, "--schema", "victim_wal", "--yes")
    _console(t, seeded)
    assert t.fired() == {}, "an overload planted by another role ran"
    assert len(schemas) == (2 if t.wal else 1)


def _console(t: Trapped, seeded: dict[str, Any]) -> None:
    """Every page of the console and each of its actions, as the console's login role, over one
    outbox and over a fleet."""
    from starlette.testclient import TestClient

    from outbox.console.web import app

    same = {"sec-fetch-site": "same-origin"}
    with pinning.connect(t.dsn, autocommit=True) as conn:  # something to redrive and to replay
        conn.execute(
            "INSERT INTO victim.dead_letters (id, event_id, topic, key, payload, headers, created_at, "
            "attempts, error, first_failed_at, failed_at, parked) VALUES (3000, gen_random_uuid(), "
            "'lost.x', 'c', '{}', '{}', now(), 3, 'no route', now(), now(), true)"
        )
    with TestClient(app(t.as_login("console"), schema="victim"), base_url="http://localhost:8000") as c:
        for path in (
            "/", "/chart.json", "/dead", "/dead/list", "/key?key=c", f"/event/{seeded['archived']}?key=k1",
            f"/event/{seeded['archived']}/payload/delivered/1000?key=k1", "/audit", "/replay",
        ):  # fmt: skip
            assert c.get(path).status_code == 200, path
        hw = re.search(r'name="hw" value="(\d+)"', c.get("/dead").text)
        assert hw is not None
        form = {"action": "redrive", "hw": hw.group(1), "id": "3000"}
        assert c.post("/dead/preview", data=form, headers=same).status_code == 200
        assert c.post("/dead/act", data=form, headers=same, follow_redirects=False).status_code == 303
        window = {"since": "1h", "topic": "orders.placed"}
        preview = c.post("/replay/preview", data=window, headers=same)
        assert preview.status_code == 200, preview.text[-500:]
        upto = re.search(r'name="upto" value="(\d+)"', preview.text)
        fields = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)"', preview.text))
        assert upto is not None, preview.text[-500:]
        act = c.post("/replay/act", data=fields, headers=same, follow_redirects=False)
        assert act.status_code == 303, act.text[-500:]
    from outbox.console.fleet import app as fleet_app
    from outbox.store.outboxes import Outbox

    outboxes = [Outbox(s, t.as_login("console"), s) for s in ("victim", "tenant_a")]
    with TestClient(fleet_app(outboxes), base_url="http://localhost:8000") as c:
        for path in ("/", "/audit", "/o/victim/", "/o/victim/dead"):
            assert c.get(path).status_code == 200, path


@pytest.mark.slow
def test_every_writer_stack_and_the_inbox_fire_no_trap(trapped: Trapped) -> None:
    t = trapped
    schemas = _migrate(t)
    before = t.fired()
    assert before == {}, "migrate ran a planted overload"
    run = subprocess.run(
        [sys.executable, "-m", "tests.trap_writers", t.as_login("writer"), t.dsn, *schemas],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert int(run.stdout.split()[-1]) == 9 * 7 * len(schemas)
    store = claim_check.PostgresStore(t.dsn, "victim")  # the relay's put, a consumer's fetch
    reference = store.put(str(uuid.uuid4()), b"x" * 100)
    store.close()
    assert claim_check.fetch(reference, store="postgres:victim", dsn=t.dsn) == b"x" * 100
    assert t.fired() == {}, "an overload planted by another role ran on an application's session"


@pytest.mark.slow
def test_the_relay_over_table_and_wal_capture_fires_no_trap(trapped: Trapped, kafka: str, topic: str) -> None:
    """The relay as its own login role: table capture with the claim-check store in PostgreSQL
    and /metrics scraped; a fleet over the WAL capture outbox and a tenant, dead letters too."""
    t = trapped
    schemas = _migrate(t)
    with pinning.connect(t.dsn) as conn:
        for schema in schemas:
            for i in range(40):
                name = f"{topic}.lost" if i % 10 == 0 else topic  # no route: dead-lettered
                payload = {"i": i, "pad": "x" * (300 if i % 7 == 0 else 0)}
                from outbox import enqueue

                key = None if name != topic else f"k{i % 5}"  # a keyed dead letter would park its key
                enqueue(conn, name, payload, key=key, schema=schema)
        conn.commit()
    route = ("--route", f"{topic}=kafka://{kafka}")  # the test's own topic on the worker's broker
    table = (
        "--dsn", t.as_login("relay"), "--schema", "victim", *route, *FAST, "--claim-check-over", "200",
        "--claim-check-store", "postgres:", "--metrics-port", str(free_port()),
    )  # fmt: skip
    relays = [ModuleProcess("outbox", "relay", *table)]
    if t.wal:
        outboxes = (
            "--outbox", f"wal={t.as_login('relay')}#victim_wal",
            "--outbox", f"tenant={t.as_login('relay')}#tenant_a",
        )  # fmt: skip
        relays.append(
            ModuleProcess("outbox", "relay", *outboxes, *route, *FAST, "--metrics-port", str(free_port()))
        )
    try:
        for schema in schemas:
            try:
                wait_for(
                    lambda s=schema: (
                        count(t.dsn, s, "delivered") == 36 and count(t.dsn, s, "dead_letters") == 4
                    ),
                    timeout=90,
                    what=f"{schema} drained",
                )
            except AssertionError:
                counts = {n: count(t.dsn, schema, n) for n in ("events", "delivered", "dead_letters")}
                raise AssertionError(
                    f"{schema}: {counts}\n" + "\n\n".join(r.output()[-6000:] for r in relays)
                ) from None
        for relay in relays:
            port = re.search(r"serving /metrics, /livez, /readyz on [^:]+:(\d+)", relay.output())
            assert port is not None, relay.output()[-2000:]
            for path in ("/metrics", "/readyz", "/livez"):
                status, _ = http_get(int(port.group(1)), path)
                assert status == 200, (path, relay.output()[-2000:])
        for relay in relays:
            assert relay.stop() == 0, relay.output()[-3000:]
    finally:
        for relay in relays:
            relay.close()
    assert t.fired() == {}, "an overload planted by another role ran as the relay"
