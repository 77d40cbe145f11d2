"""``expires_at`` on every stack, in ``enqueue`` and in ``enqueue_many`` rows (COPY's fast path
cannot write it: such a batch goes as one statement of arrays), on both captures: what is stored
(or emitted) is the instant given, to the microsecond."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import outbox
from outbox import capture
from tests.stacks import ASYNC_STACKS, SYNC_STACKS, AsyncStack, SyncStack, configure_django

AT = datetime(2031, 5, 6, 7, 8, 9, 123456, tzinfo=timezone(timedelta(hours=2)))


def _rows(events: int) -> list[dict[str, Any]]:
    """enqueue_many's rows: with and without an expiry, one delayed as well."""
    rows: list[dict[str, Any]] = [
        {"topic": "t", "payload": {"i": i}, "expires_at": AT + timedelta(seconds=i) if i % 2 else None}
        for i in range(events)
    ]
    rows.append({"topic": "t", "payload": {"i": "delayed"}, "delay": 0.001, "expires_at": AT})
    return rows


def _stored(dsn: str, schema: str) -> dict[str, datetime | None]:
    with psycopg.connect(dsn) as conn:
        return dict(conn.execute(f'SELECT event_id::text, expires_at FROM "{schema}".events').fetchall())


def _expected(single: Any, many: list[Any]) -> dict[str, datetime | None]:
    out = {str(single): AT}
    for i, event_id in enumerate(many[:-1]):
        out[str(event_id)] = AT + timedelta(seconds=i) if i % 2 else None
    out[str(many[-1])] = AT
    return out


@pytest.mark.parametrize("name", SYNC_STACKS)
def test_every_sync_stack_stores_the_expiry(name: str, pg_dsn: str, schema: str) -> None:
    if name == "django":
        configure_django(pg_dsn, "outbox")
    stack = SyncStack(name, pg_dsn)
    try:
        with stack.tx() as c:
            single = outbox.enqueue(c, "t", {"n": 1}, expires_at=AT, schema=schema)
        with stack.tx() as c:
            many = outbox.enqueue_many(c, _rows(6), schema=schema)
    finally:
        stack.close()
    assert _stored(pg_dsn, schema) == _expected(single, many)


@pytest.mark.parametrize("name", ASYNC_STACKS)
def test_every_async_stack_stores_the_expiry(name: str, pg_dsn: str, schema: str) -> None:
    stack = AsyncStack(name, pg_dsn)

    async def scenario() -> tuple[Any, list[Any]]:
        async with stack.connection() as conn:
            async with stack.tx(conn) as c:
                single = await outbox.enqueue_async(c, "t", {"n": 1}, expires_at=AT, schema=schema)
            async with stack.tx(conn) as c:
                many = await outbox.enqueue_many_async(c, _rows(6), schema=schema)
        return single, many

    single, many = asyncio.run(scenario())
    assert _stored(pg_dsn, schema) == _expected(single, many)


@pytest.mark.parametrize("name", ["psycopg", "psycopg2"])
def test_wal_capture_carries_the_expiry_in_the_message(name: str, wal_dsn: str, wal_schema: str) -> None:
    """In WAL capture the expiry travels in the signed message (a sixth field of its head, there
    only when the event has one): the reader's event has it, to the microsecond."""
    stack = SyncStack(name, wal_dsn)
    try:
        with stack.tx() as c:
            with_expiry = outbox.enqueue(c, "t", {"n": 1}, expires_at=AT, schema=wal_schema)
            without = outbox.enqueue(c, "t", {"n": 2}, schema=wal_schema)
    finally:
        stack.close()
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        slot = capture.state(conn, wal_schema).slot
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1', "
            "'publication_names', %s, 'messages', 'true')",
            (slot, capture.publication_name(wal_schema)),
        ).fetchall()
    heads = [
        bytes(r[0])
        for r in rows
        if str(with_expiry).encode() in bytes(r[0]) or str(without).encode() in bytes(r[0])
    ]
    assert len(heads) == 2
    expiry = repr(AT.timestamp()).encode()
    assert [expiry in h for h in heads] == [True, False]
