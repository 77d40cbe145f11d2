"""The writer API: bad input is refused before anything is written; the transaction survives."""

from __future__ import annotations

import asyncio
import math
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

import outbox
from tests.helpers import count

BAD_CALLS: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    ("empty topic", {"topic": "", "payload": b"x"}, ValueError, "topic"),
    ("oversized topic", {"topic": "t" * 250, "payload": b"x"}, ValueError, "topic"),
    ("topic not str", {"topic": b"t", "payload": b"x"}, TypeError, "topic"),
    ("topic with NUL", {"topic": "a\x00b", "payload": b"x"}, ValueError, "topic"),
    ("key of wrong type", {"topic": "t", "payload": b"x", "key": 42}, TypeError, "key"),
    ("oversized key", {"topic": "t", "payload": b"x", "key": "k" * 5000}, ValueError, "key"),
    (
        "key with lone surrogate",
        {"topic": "t", "payload": b"x", "key": "\ud800"},
        ValueError,
        "key",
    ),
    (
        "header name not str",
        {"topic": "t", "payload": b"x", "headers": {1: "v"}},
        TypeError,
        "headers",
    ),
    (
        "header value not str",
        {"topic": "t", "payload": b"x", "headers": {"h": 1}},
        TypeError,
        "headers",
    ),
    (
        "headers not a mapping",
        {"topic": "t", "payload": b"x", "headers": [("h", "v")]},
        TypeError,
        "headers",
    ),
    (
        "event-id header",
        {"topic": "t", "payload": b"x", "headers": {"event-id": "x"}},
        ValueError,
        "headers",
    ),
    ("payload JSON cannot encode", {"topic": "t", "payload": {1, 2}}, TypeError, "payload"),
    ("payload NaN", {"topic": "t", "payload": {"x": math.nan}}, ValueError, "payload"),
    ("payload lone surrogate", {"topic": "t", "payload": "\udfff"}, ValueError, "payload"),
    ("negative delay", {"topic": "t", "payload": b"x", "delay": -1}, ValueError, "delay"),
    (
        "negative timedelta",
        {"topic": "t", "payload": b"x", "delay": timedelta(seconds=-1)},
        ValueError,
        "delay",
    ),
    ("NaN delay", {"topic": "t", "payload": b"x", "delay": math.nan}, ValueError, "delay"),
    ("delay of wrong type", {"topic": "t", "payload": b"x", "delay": "5"}, TypeError, "delay"),
    (
        "naive expires_at",
        {"topic": "t", "payload": b"x", "expires_at": datetime(2030, 1, 1)},
        ValueError,
        "expires_at: must be timezone-aware",
    ),
    (
        "expires_at of wrong type",
        {"topic": "t", "payload": b"x", "expires_at": 1.7e9},
        TypeError,
        "expires_at",
    ),
]


@pytest.mark.parametrize(("case", "kwargs", "error", "field"), BAD_CALLS, ids=[c[0] for c in BAD_CALLS])
def test_bad_input_names_the_field_and_writes_nothing(
    pg_dsn: str, schema: str, case: str, kwargs: dict[str, Any], error: type[Exception], field: str
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, "ok", b"before", schema=schema)
        with pytest.raises(error, match=field):
            outbox.enqueue(conn, schema=schema, **kwargs)
        with pytest.raises(error, match=rf"events\[1\]\.{field}"):
            outbox.enqueue_many(conn, [{"topic": "ok", "payload": b"1"}, kwargs], schema=schema)
        # The caller's transaction is still usable and commits what it had.
        conn.execute("SELECT 1")
        conn.commit()
    assert count(pg_dsn, schema, "events") == 1


def test_unknown_schema_is_refused_and_transaction_survives(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, "ok", b"x", schema=schema)
        with pytest.raises(ValueError, match="schema"):
            outbox.enqueue(conn, "t", b"x", schema="no_such_schema")
        with pytest.raises(ValueError, match="schema"):
            outbox.enqueue(conn, "t", b"x", schema="")
        with pytest.raises(ValueError, match="schema"):
            outbox.enqueue_many(conn, [{"topic": "t", "payload": b"x"}], schema="no_such_schema")
        conn.commit()
    assert count(pg_dsn, schema, "events") == 1


def test_wrong_connection_type_is_refused(pg_dsn: str, schema: str) -> None:
    with pytest.raises(TypeError, match="conn"):
        outbox.enqueue("postgresql://", "t", b"x", schema=schema)  # type: ignore[arg-type]


def test_delay_and_cursor(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn) as conn, conn.cursor() as cur:
        outbox.enqueue(cur, "t", b"x", delay=timedelta(hours=1), schema=schema)
        outbox.enqueue_many(
            cur,
            [{"topic": "t", "payload": b"y", "delay": 3600.0}, {"topic": "t", "payload": b"z"}],
            schema=schema,
        )
    assert count(pg_dsn, schema, "events", "available_at > now() + interval '59 minutes'") == 2
    assert count(pg_dsn, schema, "events") == 3


def test_async_twins(pg_dsn: str, schema: str) -> None:
    async def main() -> list[Any]:
        async with await psycopg.AsyncConnection.connect(pg_dsn) as aconn:
            one = await outbox.enqueue_async(aconn, "t", {"a": 1}, key="k", schema=schema)
            many = await outbox.enqueue_many_async(
                aconn, [{"topic": "t", "payload": str(i)} for i in range(100)], schema=schema
            )
            with pytest.raises(ValueError, match="topic"):
                await outbox.enqueue_async(aconn, "", b"x", schema=schema)
            return [one, *many]

    ids = asyncio.run(main())
    assert len(set(ids)) == 101
    assert count(pg_dsn, schema, "events") == 101


def test_atomic_with_business_data(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(f'CREATE TABLE "{schema}".orders (id int)')
        conn.commit()
        with pytest.raises(RuntimeError), conn.transaction():
            conn.execute(f'INSERT INTO "{schema}".orders VALUES (1)')
            outbox.enqueue(conn, "orders", {"id": 1}, schema=schema)
            raise RuntimeError("rollback")
        with conn.transaction():
            conn.execute(f'INSERT INTO "{schema}".orders VALUES (2)')
            outbox.enqueue(conn, "orders", {"id": 2}, schema=schema)
    assert count(pg_dsn, schema, "orders") == 1
    assert count(pg_dsn, schema, "events") == 1
