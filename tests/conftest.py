"""Shared fixtures: a real PostgreSQL and a real Kafka-protocol broker.

PostgreSQL: ``OUTBOX_TEST_DSN``, else the server on 127.0.0.1:5432 (database
``test``), else an embedded one. Each test gets its own migrated schema.
Kafka: ``OUTBOX_TEST_KAFKA``, else a Tansu broker spawned on a free port. Each
test gets its own topic names.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox.embedded import Broker, embedded_postgres
from outbox.migrate import migrate

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


@pytest.fixture(scope="session")
def pg_dsn() -> Iterator[str]:
    dsn = os.environ.get("OUTBOX_TEST_DSN")
    if dsn:
        yield dsn
        return
    try:
        psycopg.connect(LOCAL_DSN).close()
    except psycopg.OperationalError:
        with embedded_postgres() as embedded:
            yield embedded
        return
    yield LOCAL_DSN


@pytest.fixture
def schema(pg_dsn: str) -> Iterator[str]:
    name = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, name)
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


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
