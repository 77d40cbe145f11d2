"""Behind a real PgBouncer (tests/pgbouncer.py): every writer stack and the inbox through
transaction pooling, the relay refused there and working in session mode."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.relay.config import RelayConfig
from tests.helpers import RelayProcess, count, read_topic, running_relay, wait_for
from tests.pgbouncer_writers import STACKS
from tests.stacks import url

CLIENTS = 8  # concurrent connections, more than the pool's server connections
TRANSACTIONS = 150  # per connection: 1,200 a stack, each client's session swapped constantly


def _clients(
    sync_client: Callable[[psycopg.Connection[Any]], None],
    async_client: Callable[[Any], Awaitable[None]],
    dsn: str,
) -> list[BaseException]:
    """CLIENTS threads at once, half on psycopg 3 (``sync_client(conn)``), half on asyncpg
    (``await async_client(conn)``), each with its own connection to ``dsn`` on the drivers'
    defaults; the errors they raised."""
    errors: list[BaseException] = []

    def run_sync() -> None:
        try:
            with psycopg.connect(dsn) as conn:
                sync_client(conn)
        except BaseException as exc:
            errors.append(exc)

    def run_async() -> None:
        async def main() -> None:
            import asyncpg

            conn = await asyncpg.connect(url(dsn, ""))
            try:
                await async_client(conn)
            finally:
                await conn.close()

        try:
            asyncio.run(main())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run_sync if i % 2 else run_async) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.slow
@pytest.mark.parametrize("stack", STACKS)
def test_every_writer_stack_through_transaction_pooling_delivers_each_event_once(
    stack: str, pg_dsn: str, schema: str, kafka: str, topic: str, pgbouncer: Any
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {}.orders (id bigserial PRIMARY KEY, n int)").format(sql.Identifier(schema))
        )
    proc = subprocess.run(
        [sys.executable, "-m", "tests.pgbouncer_writers", stack, pgbouncer.dsn("transaction"), schema, topic,
         str(TRANSACTIONS), str(CLIENTS)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    committed = json.loads(proc.stdout)
    n = CLIENTS * TRANSACTIONS
    assert len(committed) == len(set(committed)) == n
    assert count(pg_dsn, schema, "orders") == n
    with running_relay(RelayConfig(pg_dsn, schema=schema, poll_interval=0.2), bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=120, what="drain")
    messages = read_topic(kafka, topic, n, timeout=60)
    assert sorted(m.event_id for m in messages) == sorted(committed), "lost or delivered twice"
    assert count(pg_dsn, schema, "delivered") == n


def test_the_inbox_through_transaction_pooling_records_each_event_once(
    pg_dsn: str, schema: str, pgbouncer: Any
) -> None:
    """Eight consumers race on the same event ids through transaction pooling, on the drivers'
    defaults (psycopg prepares after 5 runs, asyncpg caches named statements): the inbox's
    statements are the only ones they run, and they work; each id is first exactly once."""
    ids = [uuid.uuid4() for _ in range(300)]
    firsts: list[uuid.UUID] = []

    def sync_consumer(conn: psycopg.Connection[Any]) -> None:
        for event_id in ids:
            with conn.transaction():
                if outbox.inbox.first_delivery(conn, "billing", event_id, schema=schema):
                    firsts.append(event_id)

    async def async_consumer(conn: Any) -> None:
        for event_id in reversed(ids):
            async with conn.transaction():
                if await outbox.inbox.first_delivery_async(conn, "billing", event_id, schema=schema):
                    firsts.append(event_id)

    errors = _clients(sync_consumer, async_consumer, pgbouncer.dsn("transaction"))
    assert errors == []
    assert sorted(firsts) == sorted(ids)
    assert count(pg_dsn, schema, "inbox") == len(ids)


@pytest.mark.parametrize("mode", ["transaction", "statement"])
def test_the_relay_refuses_a_transaction_pooling_dsn_in_one_line(
    mode: str, schema: str, pgbouncer: Any
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "outbox", "relay", "--dsn", pgbouncer.dsn(mode), "--schema", schema,
         "--kafka-bootstrap", "127.0.0.1:9"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert (
        "pool_mode=transaction" in lines[0] and "direct DSN" in lines[0] and "pool_mode=session" in lines[0]
    )


def test_the_relay_works_through_session_pooling_and_wakes_on_notify(
    pg_dsn: str, schema: str, kafka: str, topic: str, pgbouncer: Any
) -> None:
    """The relay behind PgBouncer in session mode: it starts (no `options` startup parameter,
    which PgBouncer refuses), a NOTIFY wakes it long before its 30 s poll, and the pids it
    records are the server's own (not the ones PgBouncer tells its clients)."""
    dsn = pgbouncer.dsn("session")
    with RelayProcess(dsn, schema, kafka, "--poll-interval", "30") as relay:
        wait_for(lambda: count(pg_dsn, schema, "relays") == 1, timeout=30, what="the relay registered")
        wait_for(lambda: count(pg_dsn, schema, "partitions", "owner IS NOT NULL") == 64, timeout=30)
        time.sleep(1)  # past its first claim: from here only a NOTIFY (or the 30 s poll) wakes it
        with psycopg.connect(dsn) as conn:  # the writer through the same pooler
            sent = [outbox.enqueue(conn, topic, {"i": i}, key=f"k{i}", schema=schema) for i in range(20)]
        started = time.monotonic()
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 20, timeout=15, what="delivery")
        woke_after = time.monotonic() - started
        recorded = sql.SQL(
            "SELECT unnest(f.backend_pids) FROM {}.relays AS r JOIN outbox_fleet.relays AS f ON f.id = r.id"
        ).format(sql.Identifier(schema))
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            # Recorded at each heartbeat (every 2 s here), once the claims have opened sessions.
            wait_for(lambda: bool(conn.execute(recorded).fetchall()), timeout=15, what="pids recorded")
            pids = conn.execute(recorded).fetchall()
            relay_sessions = {
                pid
                for (pid,) in conn.execute(
                    "SELECT pid FROM pg_stat_activity WHERE application_name = 'outbox-relay' "
                    "AND datname = current_database()"
                ).fetchall()
            }
        assert relay.stop() == 0
    assert woke_after < 10, f"not woken by NOTIFY: delivered {woke_after:.1f} s after the commit"
    assert pids and {p for (p,) in pids} <= set(relay_sessions), "recorded pids are not the server's"
    messages = read_topic(kafka, topic, 20)
    assert sorted(m.event_id for m in messages) == sorted(map(str, sent))


def test_enqueue_through_transaction_pooling_on_the_drivers_defaults(
    pg_dsn: str, schema: str, pgbouncer: Any
) -> None:
    """The app's connections as the drivers make them (psycopg 3 prepares a statement run 5
    times, asyncpg caches named prepared statements): the outbox's own statements are never
    prepared server-side, so enqueue and enqueue_many work whatever the app's settings. Run on
    a prepared statement, 8 clients over 3 server connections fail within a few transactions."""
    rounds = 300

    def sync_writer(conn: psycopg.Connection[Any]) -> None:
        for i in range(rounds):
            with conn.transaction():
                outbox.enqueue(conn, "t", {"i": i}, key=f"k{i % 7}", schema=schema)
                outbox.enqueue_many(conn, [{"topic": "t", "payload": {"j": i}}] * 2, schema=schema)

    async def async_writer(conn: Any) -> None:
        for i in range(rounds):
            async with conn.transaction():
                await outbox.enqueue_async(conn, "t", {"i": i}, key=f"k{i % 7}", schema=schema)
                await outbox.enqueue_many_async(
                    conn, [{"topic": "t", "payload": {"j": i}}] * 2, schema=schema
                )

    errors = _clients(sync_writer, async_writer, pgbouncer.dsn("transaction"))
    assert errors == [], errors[:1]
    assert count(pg_dsn, schema, "events") == CLIENTS * rounds * 3
