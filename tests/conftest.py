"""Shared fixtures: a real PostgreSQL and a real Kafka-protocol broker.

PostgreSQL: ``OUTBOX_TEST_DSN``, else the server on 127.0.0.1:5432 (database
``test``), else an embedded one. Under pytest-xdist each worker gets a database of its
own on that server (``outbox_test_<run>_<worker>``, made afresh), so a test that looks at
database-wide state (every table, every relay session) sees only its worker's, and one
that ends "every relay session" ends only its own. Each test gets its own migrated schema.
Kafka: ``OUTBOX_TEST_KAFKA``, else a Tansu broker spawned on a free port (one per worker:
session fixtures are per worker). Each test gets its own topic names, and the other sinks'
fixtures their own exchanges, streams, key prefixes and paths.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox.harness.embedded import Broker, embedded_postgres
from outbox.store.migrate import migrate
from tests.helpers import kept

# Variables that would change what the code under test connects to.
for _name in list(os.environ):
    if (_name.startswith("OUTBOX_") and not _name.startswith("OUTBOX_TEST_")) or _name in {
        "PGHOST",
        "PGPORT",
        "PGDATABASE",
        "PGUSER",
        "PGPASSWORD",
        "PGSERVICE",
    }:
        del os.environ[_name]

LOCAL_DSN = "host=127.0.0.1 port=5432 dbname=test user=root connect_timeout=3"


@contextlib.contextmanager
def _worker_database(dsn: str) -> Iterator[str]:
    """``dsn`` itself when not under xdist; else a database of this worker's, made afresh."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        yield dsn
        return
    # The run's id too: two suites at once (a developer's and a matrix) must not share one.
    dbname = f"outbox_test_{os.environ.get('PYTEST_XDIST_TESTRUNUID', '')[:8]}_{worker}"
    name = sql.Identifier(dbname)
    drop = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name)
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(drop)
        admin.execute(sql.SQL("CREATE DATABASE {}").format(name))
    try:
        yield make_conninfo(dsn, dbname=dbname)
    finally:
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(drop)


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    with contextlib.ExitStack() as stack:
        dsn = os.environ.get("OUTBOX_TEST_DSN")
        if not dsn:
            try:
                psycopg.connect(LOCAL_DSN).close()
                dsn = LOCAL_DSN
            except psycopg.OperationalError:
                dsn = stack.enter_context(embedded_postgres())
        yield stack.enter_context(_worker_database(dsn))


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    kept(pg_dsn, lambda conn: migrate(conn, name))  # on the worker's kept session (tests.helpers)
    yield name
    kept(pg_dsn, lambda conn: conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name))))


@pytest.fixture
def second_db(pg_dsn: str) -> Iterator[str]:
    """A database of this test's own on the same server (its relays the only ones there); its DSN."""
    name = f"outbox_fa_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = make_conninfo(pg_dsn, dbname=name)
    yield dsn
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def _wal_level(dsn: str) -> tuple[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT current_setting('wal_level'), current_setting('server_version_num')::int"
        ).fetchone()
        assert row is not None
        return str(row[0]), int(row[1])


@pytest.fixture(scope="session")
def wal_dsn(pg_dsn: str) -> Iterator[str]:
    """A PostgreSQL with wal_level=logical (WAL capture): the suite's own when it is one (the
    matrix's servers), else one of this worker's own (the machine's runs with replica)."""
    level, version = _wal_level(pg_dsn)
    if level == "logical":
        if version < 140000:
            pytest.skip(f"WAL capture needs PostgreSQL 14 or later (server is {version // 10000})")
        yield pg_dsn
        return
    from tests.pgserver import Server

    server = Server("18").start()
    try:
        yield server.dsn
    finally:
        server.remove()


@pytest.fixture
def wal_schema(wal_dsn: str) -> Iterator[str]:
    """A migrated outbox switched to WAL capture; its slot, publication and schema dropped after."""
    from outbox import capture

    name = f"w_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        migrate(conn, name)
        capture.switch(conn, name, "wal")
    yield name
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        slot, publication = capture.state(conn, name).slot, capture.publication_name(name)
        for _ in range(100):  # a relay's reader may still be letting go of the slot
            row = conn.execute(
                "SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            ).fetchone()
            if row is None or not row[0]:
                break
            time.sleep(0.1)
        conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
            (slot,),
        )
        conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(publication)))
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def prefix(pg_dsn: str) -> Iterator[str]:
    """A prefix of this test's own for the schemas it makes (tenants: <prefix>_<n>); every schema
    that starts with it is dropped afterwards."""
    name = f"p{uuid.uuid4().hex[:11]}"
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT nspname FROM pg_namespace WHERE starts_with(nspname, %s)", (name,)
        ).fetchall()
        for (schema,) in rows:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def conn(pg_dsn: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(pg_dsn) as c:
        yield c


@pytest.fixture(scope="session")
def kafka() -> Iterator[str]:
    bootstrap = os.environ.get("OUTBOX_TEST_KAFKA")
    if bootstrap:
        yield bootstrap
        return
    with Broker() as broker:
        yield broker.bootstrap


@pytest.fixture
def own_broker() -> Iterator[Broker]:
    """A broker this test may stop and start."""
    broker = Broker().start()
    yield broker
    broker.stop()


@pytest.fixture
def topic() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


@pytest.fixture(scope="session")
def pgbouncer(pg_dsn: str) -> Iterator[Any]:
    """A real PgBouncer in front of this worker's database (tests/pgbouncer.py)."""
    from tests.pgbouncer import PgBouncer

    bouncer = PgBouncer(pg_dsn).start()
    yield bouncer
    bouncer.stop()


@pytest.fixture(scope="session")
def moto_server() -> Iterator[Any]:
    """moto in server mode, this worker's (tests/aws_servers.py)."""
    from tests.aws_servers import Moto

    server = Moto().start()
    yield server
    server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """moto's credentials and region in the environment, for the relay and the clients."""
    from tests.aws_servers import CREDENTIALS

    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    return dict(CREDENTIALS)


# Modules whose tests each take tens of seconds (real processes, fault scenarios, bench races);
# the first two, a minute or two each (an `outbox bench` process per test), go first of all.
LONGEST_MODULES = ("test_faults.py", "test_bench.py")
LONG_MODULES = (*LONGEST_MODULES, "test_multi_relay.py", "test_process.py", "test_inputs.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest tests first (kept in their order otherwise): pytest-xdist hands tests out in
    collection order, so a long test collected last runs alone at the end while the other
    workers idle. Longest first is the classic fix (LPT scheduling); it changes no result."""

    def length(item: pytest.Item) -> int:
        if item.path.name in LONGEST_MODULES:
            return 0
        return 1 if item.get_closest_marker("slow") is not None or item.path.name in LONG_MODULES else 2

    items.sort(key=length)
