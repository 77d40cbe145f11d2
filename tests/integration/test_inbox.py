"""The consumer inbox on real PostgreSQL: ``first_delivery`` on every stack ``enqueue`` takes
(true once, false for a duplicate, rolled back with the consumer's transaction, independent
per consumer name), the race between two deliveries of one event, bad input, the inbox in a
database of its own (``migrate --inbox-only``) and ``inbox prune``."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import uuid
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox import inbox
from outbox.cli import main
from outbox.errors import ConfigError, InvalidType, NotMigrated, OutsideTransaction, UnsupportedConnection
from outbox.store.migrate import applied_versions, migrate, migrations
from tests.helpers import count
from tests.stacks import ASYNC_STACKS, SYNC_STACKS, AsyncStack, SyncStack, configure_django


@pytest.mark.parametrize("name", SYNC_STACKS)
def test_first_delivery_is_true_once_per_consumer_and_rolls_back_with_the_handler(
    name: str, pg_dsn: str, schema: str
) -> None:
    if name == "django":
        configure_django(pg_dsn, "outbox")
    stack = SyncStack(name, pg_dsn)
    event = str(uuid.uuid4())
    try:
        with stack.rollback_tx() as c:  # the handler failed: nothing recorded
            assert inbox.first_delivery(c, "billing", event, schema=schema) is True
        with stack.tx() as c:
            assert inbox.first_delivery(c, "billing", event, schema=schema) is True
        with stack.tx() as c:
            assert inbox.first_delivery(c, "billing", event, schema=schema) is False
            assert inbox.first_delivery(c, "billing", event.encode(), schema=schema) is False  # header bytes
            assert inbox.first_delivery(c, "billing", uuid.UUID(event), schema=schema) is False
            assert inbox.first_delivery(c, "shipping", event, schema=schema) is True  # another consumer
        with stack.tx() as c:
            with stack.savepoint():
                assert inbox.first_delivery(c, "audit", event, schema=schema) is True
            assert inbox.first_delivery(c, "audit", event, schema=schema) is True  # the savepoint rolled back
    finally:
        stack.close()
    rows = count(pg_dsn, schema, "inbox")
    assert rows == 3, "billing, shipping and audit: one row each"


@pytest.mark.parametrize("name", ASYNC_STACKS)
def test_first_delivery_async_on_every_async_stack(name: str, pg_dsn: str, schema: str) -> None:
    event = str(uuid.uuid4())

    async def scenario() -> list[bool]:
        stack = AsyncStack(name, pg_dsn)
        seen = []
        async with stack.connection() as conn:
            async with stack.tx(conn, rollback=True) as c:
                seen.append(await inbox.first_delivery_async(c, "billing", event, schema=schema))
            async with stack.tx(conn) as c:
                seen.append(await inbox.first_delivery_async(c, "billing", event, schema=schema))
            async with stack.tx(conn) as c:
                seen.append(await inbox.first_delivery_async(c, "billing", event, schema=schema))
                seen.append(await inbox.first_delivery_async(c, "shipping", event, schema=schema))
        return seen

    assert asyncio.run(scenario()) == [True, True, False, True]
    assert count(pg_dsn, schema, "inbox") == 2


def test_a_second_delivery_waits_for_the_first_and_follows_its_outcome(pg_dsn: str, schema: str) -> None:
    """Two consumers of one name get the same event at once (a rebalance): the second waits on
    the first's row; a rollback of the first makes the second the first delivery, a commit a
    duplicate."""
    for first_commits, second_sees in ((False, True), (True, False)):
        event = str(uuid.uuid4())
        with psycopg.connect(pg_dsn) as a, psycopg.connect(pg_dsn) as b:
            assert inbox.first_delivery(a, "billing", event, schema=schema) is True
            result: list[bool] = []

            def deliver(conn: psycopg.Connection[Any], event: str, result: list[bool]) -> None:
                result.append(inbox.first_delivery(conn, "billing", event, schema=schema))

            second = threading.Thread(target=deliver, args=(b, event, result))
            second.start()
            second.join(0.5)
            assert second.is_alive(), "the second delivery must wait for the first's transaction"
            a.commit() if first_commits else a.rollback()
            second.join(10)
            b.commit()
        assert result == [second_sees]


def test_bad_input_is_refused_naming_the_argument(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(ConfigError, match=r"^consumer: must not be empty"):
            inbox.first_delivery(conn, "", "e1", schema=schema)
        with pytest.raises(InvalidType, match=r"^event_id: expected str, bytes or UUID, got int"):
            inbox.first_delivery(conn, "billing", 42, schema=schema)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match=r"^event_id: not UTF-8 text"):
            inbox.first_delivery(conn, "billing", b"\xff", schema=schema)
        with pytest.raises(ConfigError, match=r"^event_id: at most 255 characters"):
            inbox.first_delivery(conn, "billing", "x" * 256, schema=schema)
        with pytest.raises(UnsupportedConnection, match=r"^conn: expected a psycopg Connection"):
            inbox.first_delivery(object(), "billing", "e1", schema=schema)

        async def sync_call_on_async_connection() -> None:
            async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
                inbox.first_delivery(aconn, "billing", "e1", schema=schema)

        with pytest.raises(UnsupportedConnection, match=r"use `await first_delivery_async\(\.\.\.\)`"):
            asyncio.run(sync_call_on_async_connection())
        conn.rollback()
    with (
        psycopg.connect(pg_dsn, autocommit=True) as conn,
        pytest.raises(OutsideTransaction, match=r"^conn: .* not in a transaction"),
    ):
        inbox.first_delivery(conn, "billing", "e1", schema=schema)
    assert count(pg_dsn, schema, "inbox") == 0, "nothing recorded by a refused call"


def test_inbox_only_in_a_consumers_own_database_then_the_rest(pg_dsn: str, capsys: Any) -> None:
    """``migrate --inbox-only`` creates just the inbox; ``first_delivery`` works there; the
    outbox's migrations can follow later without touching it."""
    name = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with psycopg.connect(pg_dsn) as conn, pytest.raises(NotMigrated, match=r"--inbox-only"):
            inbox.first_delivery(conn, "billing", "e1", schema=name)
        assert main(["migrate", "--dsn", pg_dsn, "--schema", name, "--inbox-only"]) == 0
        assert "applied 0005_inbox" in capsys.readouterr().out
        with psycopg.connect(pg_dsn) as conn:
            tables = conn.execute(
                "SELECT array_agg(tablename::text ORDER BY tablename) FROM pg_tables WHERE schemaname = %s",
                (name,),
            ).fetchone()
            assert tables == (["inbox", "schema_migrations"],)
            assert inbox.first_delivery(conn, "billing", "e1", schema=name) is True
            conn.commit()
            migrate(conn, name)  # the full set later: the inbox is left as it is
            assert sorted(applied_versions(conn, name)) == [m.version for m in migrations()]
            assert inbox.first_delivery(conn, "billing", "e1", schema=name) is False
            conn.rollback()
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_prune_deletes_old_records_in_chunks_and_keeps_recent_ones(
    pg_dsn: str, schema: str, capsys: Any
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.inbox (consumer, event_id, received_at) "
                "SELECT 'billing', 'old-' || i, now() - interval '8 days' FROM generate_series(1, 25) i "
                "UNION ALL SELECT 'billing', 'new-' || i, now() - interval '1 day' FROM generate_series(1, 5) i"
            ).format(sql.Identifier(schema))
        )
        conn.commit()
    assert (
        main(["inbox", "prune", "--dsn", pg_dsn, "--schema", schema, "--older-than", "7d", "--dry-run"]) == 0
    )
    assert "would delete 25 inbox records" in capsys.readouterr().out
    assert count(pg_dsn, schema, "inbox") == 30
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        chunks: list[int] = []
        deleted = inbox.prune(conn, dt.timedelta(days=7), schema=schema, chunk=10, progress=chunks.append)
    assert (deleted, chunks) == (25, [10, 20, 25])
    assert count(pg_dsn, schema, "inbox", "event_id LIKE 'new-%'") == 5
    assert count(pg_dsn, schema, "inbox") == 5
    assert main(["inbox", "prune", "--dsn", pg_dsn, "--schema", schema, "--older-than", "12h"]) == 0
    assert "deleted 5 inbox records" in capsys.readouterr().out
    assert main(["inbox", "prune", "--dsn", pg_dsn, "--schema", schema, "--older-than", "soon"]) == 2
    assert "--older-than: expected a duration" in capsys.readouterr().err
