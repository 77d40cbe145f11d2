"""``enqueue`` on every database stack: what commits is delivered byte-exact, what rolls
back (a transaction, a savepoint) never is, bad input is refused before anything is
written and leaves the transaction usable, ``enqueue_many`` takes the stack's fast path,
and async stacks enqueue concurrently with every committed event arriving once."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import TracerProvider
from psycopg import sql

import outbox
from outbox.errors import InvalidEvent, InvalidEventType, OutsideTransaction, UnsupportedConnection
from outbox.relay.config import RelayConfig
from tests.helpers import count, read_topic, running_relay, wait_for
from tests.stacks import ASYNC_STACKS, SYNC_STACKS, AsyncStack, SyncStack, configure_django

MANY = 10_000
TRACER = TracerProvider().get_tracer("app")  # a span of the app's request: its context goes in the headers
TRACEPARENTS: dict[str, str] = {}


def _traceparent(span: Any) -> str:
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"


def _drain(dsn: str, schema: str, kafka: str, total: int) -> None:
    with running_relay(RelayConfig(dsn, schema=schema), bootstrap=kafka) as relay:
        wait_for(lambda: relay.stats.delivered >= total, timeout=60, what=f"{total} delivered")


def _check_delivered(
    kafka: str, topic: str, expected: dict[str, tuple[bytes, bytes | None, dict[str, bytes | None]]]
) -> None:
    """Exactly the ``expected`` events (event id -> value, key, headers among theirs), byte-exact."""
    messages = read_topic(kafka, topic, len(expected))
    by_id = {m.event_id: m for m in messages}
    assert len(messages) == len(expected), [m.event_id for m in messages]
    assert set(by_id) == set(expected)
    for event_id, (value, key, headers) in expected.items():
        m = by_id[event_id]
        assert (m.value, m.key) == (value, key)
        assert {k: m.headers.get(k) for k in headers} == headers


def _bad_inputs(conn: Any, topic: str, schema: str) -> None:
    """Each bad input: its error, naming the field; nothing written."""
    with pytest.raises(InvalidEventType, match=r"^headers\['h'\]: "):
        outbox.enqueue(conn, topic, {"n": 4}, headers={"h": 5}, schema=schema)  # type: ignore[dict-item]
    with pytest.raises(InvalidEvent, match=r"^topic: must not be empty"):
        outbox.enqueue(conn, "", {"n": 5}, schema=schema)
    with pytest.raises(InvalidEvent, match=r"^delay: must not be negative"):
        outbox.enqueue(conn, topic, {"n": 6}, delay=-1, schema=schema)
    with pytest.raises(InvalidEventType, match=r"^events\[1\]\.payload: "):
        outbox.enqueue_many(
            conn, [{"topic": topic, "payload": 1}, {"topic": topic, "payload": {1j}}], schema=schema
        )


@pytest.mark.parametrize("name", SYNC_STACKS)
def test_sync_stack_delivers_what_commits_and_nothing_else(
    name: str, pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    if name == "django":
        configure_django(pg_dsn, "outbox")
    many_topic = f"{topic}-many"
    stack = SyncStack(name, pg_dsn)
    try:
        with stack.tx() as c, TRACER.start_as_current_span("POST /orders") as request:
            first = outbox.enqueue(
                c, topic, {"n": 1, "stack": name}, key="k1", headers={"x-tenant": "t1"}, schema=schema
            )
            parent = _traceparent(request)
        with stack.rollback_tx() as c:
            outbox.enqueue(c, topic, {"n": 2}, key="k1", schema=schema)
        with stack.tx() as c:
            second = outbox.enqueue(c, topic, b"\x00raw", key=b"\xffk2", schema=schema)
            with stack.savepoint():
                outbox.enqueue(c, topic, {"n": 3}, key="k2", schema=schema)
        with stack.tx() as c:
            _bad_inputs(c, topic, schema)
            third = outbox.enqueue(c, topic, "after the errors", schema=schema)  # the transaction goes on
        with stack.tx() as c:
            ids = outbox.enqueue_many(
                c,
                [{"topic": many_topic, "key": f"k{i % 10}", "payload": {"i": i}} for i in range(MANY)],
                schema=schema,
            )
        assert len(set(ids)) == MANY
    finally:
        stack.close()
    assert count(pg_dsn, schema, "events") == 3 + MANY
    _drain(pg_dsn, schema, kafka, 3 + MANY)
    _check_delivered(
        kafka,
        topic,
        {
            str(first): (
                json.dumps({"n": 1, "stack": name}, separators=(",", ":")).encode(),
                b"k1",
                {"content-type": b"application/json", "x-tenant": b"t1", "traceparent": parent.encode()},
            ),
            str(second): (b"\x00raw", b"\xffk2", {"traceparent": None}),
            str(third): (b"after the errors", None, {"content-type": None}),
        },
    )
    assert count(pg_dsn, schema, "delivered", f"topic = '{many_topic}'") == MANY


async def _async_scenario(stack: AsyncStack, topic: str, schema: str) -> dict[str, uuid.UUID]:
    out: dict[str, uuid.UUID] = {}
    async with stack.connection() as conn:
        async with stack.tx(conn) as c:
            with TRACER.start_as_current_span("POST /orders") as request:
                out["first"] = await outbox.enqueue_async(
                    c,
                    topic,
                    {"n": 1, "stack": stack.name},
                    key="k1",
                    headers={"x-tenant": "t1"},
                    schema=schema,
                )
                TRACEPARENTS[stack.name] = _traceparent(request)
        async with stack.tx(conn, rollback=True) as c:
            await outbox.enqueue_async(c, topic, {"n": 2}, key="k1", schema=schema)
        async with stack.tx(conn) as c:
            out["second"] = await outbox.enqueue_async(c, topic, b"\x00raw", key=b"\xffk2", schema=schema)
            async with stack.savepoint(c):
                await outbox.enqueue_async(c, topic, {"n": 3}, key="k2", schema=schema)
        async with stack.tx(conn) as c:
            with pytest.raises(InvalidEventType, match=r"^headers\['h'\]: "):
                await outbox.enqueue_async(c, topic, {"n": 4}, headers={"h": 5}, schema=schema)  # type: ignore[dict-item]
            with pytest.raises(InvalidEvent, match=r"^topic: must not be empty"):
                await outbox.enqueue_async(c, "", {"n": 5}, schema=schema)
            with pytest.raises(InvalidEventType, match=r"^events\[1\]\.payload: "):
                await outbox.enqueue_many_async(
                    c, [{"topic": topic, "payload": 1}, {"topic": topic, "payload": {1j}}], schema=schema
                )
            out["third"] = await outbox.enqueue_async(c, topic, "after the errors", schema=schema)
        async with stack.tx(conn) as c:
            ids = await outbox.enqueue_many_async(
                c,
                [{"topic": f"{topic}-many", "key": f"k{i % 10}", "payload": {"i": i}} for i in range(MANY)],
                schema=schema,
            )
            assert len(set(ids)) == MANY
    return out


async def _concurrent(stack: AsyncStack, topic: str, schema: str, tasks: int, each: int) -> list[uuid.UUID]:
    """``tasks`` tasks, each on its own connection, each committing ``each`` transactions of one event."""

    async def one(t: int) -> list[uuid.UUID]:
        ids = []
        async with stack.connection() as conn:
            for i in range(each):
                async with stack.tx(conn) as c:
                    ids.append(
                        await outbox.enqueue_async(
                            c, topic, {"task": t, "i": i}, key=f"task-{t}", schema=schema
                        )
                    )
        return ids

    return [i for ids in await asyncio.gather(*(one(t) for t in range(tasks))) for i in ids]


@pytest.mark.parametrize("name", ASYNC_STACKS)
def test_async_stack_delivers_what_commits_and_nothing_else(
    name: str, pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    stack = AsyncStack(name, pg_dsn)
    ids = asyncio.run(_async_scenario(stack, topic, schema))
    concurrent_topic = f"{topic}-concurrent"
    concurrent = asyncio.run(_concurrent(stack, concurrent_topic, schema, tasks=8, each=25))
    total = 3 + MANY + len(concurrent)
    assert count(pg_dsn, schema, "events") == total
    _drain(pg_dsn, schema, kafka, total)
    _check_delivered(
        kafka,
        topic,
        {
            str(ids["first"]): (
                json.dumps({"n": 1, "stack": name}, separators=(",", ":")).encode(),
                b"k1",
                {
                    "content-type": b"application/json",
                    "x-tenant": b"t1",
                    "traceparent": TRACEPARENTS[name].encode(),
                },
            ),
            str(ids["second"]): (b"\x00raw", b"\xffk2", {"traceparent": None}),
            str(ids["third"]): (b"after the errors", None, {"content-type": None}),
        },
    )
    arrived = read_topic(kafka, concurrent_topic, len(concurrent))
    assert sorted(m.event_id for m in arrived) == sorted(map(str, concurrent))  # each once
    assert count(pg_dsn, schema, "delivered", f"topic = '{topic}-many'") == MANY


# -- outside a transaction, and objects that are not connections -------------------------


def test_autocommit_outside_a_transaction_is_refused_on_every_stack(pg_dsn: str, schema: str) -> None:
    import psycopg2
    from sqlalchemy import create_engine

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        with pytest.raises(
            OutsideTransaction, match=r"^conn: the psycopg connection is not in a transaction"
        ):
            outbox.enqueue(conn, "t", b"x", schema=schema)
        with conn.transaction():  # the same connection inside a transaction block: fine
            outbox.enqueue(conn, "t", b"x", schema=schema)
    raw2 = psycopg2.connect(pg_dsn)
    raw2.autocommit = True
    try:
        with pytest.raises(OutsideTransaction, match=r"^conn: the psycopg2 connection"):
            outbox.enqueue(raw2, "t", b"x", schema=schema)
    finally:
        raw2.close()
    engine = create_engine(_sa_url(pg_dsn, "psycopg"), isolation_level="AUTOCOMMIT")
    try:
        with (
            engine.connect() as sa,
            pytest.raises(OutsideTransaction, match=r"^conn: the SQLAlchemy \(psycopg\) connection"),
        ):
            outbox.enqueue(sa, "t", b"x", schema=schema)
    finally:
        engine.dispose()

    async def asyncpg_outside() -> None:
        import asyncpg

        conn = await asyncpg.connect(_sa_url(pg_dsn, ""))
        try:
            with pytest.raises(OutsideTransaction, match=r"^conn: the asyncpg connection"):
                await outbox.enqueue_async(conn, "t", b"x", schema=schema)
        finally:
            await conn.close()

    asyncio.run(asyncpg_outside())
    configure_django(pg_dsn, "outbox")
    from django.db import connection

    with pytest.raises(OutsideTransaction, match=r"^conn: the Django connection .*transaction\.atomic"):
        outbox.enqueue(connection, "t", b"x", schema=schema)
    assert count(pg_dsn, schema, "events") == 1  # only the one inside conn.transaction()


def _sa_url(dsn: str, driver: str) -> str:
    from tests.stacks import url

    return url(dsn, driver)


def test_unsupported_objects_get_a_type_error_listing_the_stacks(pg_dsn: str) -> None:
    with pytest.raises(
        UnsupportedConnection, match=r"^conn: expected a psycopg Connection.*Django connection; got str"
    ):
        outbox.enqueue("postgresql://", "t", b"x")  # type: ignore[arg-type]
    with (
        psycopg.connect(pg_dsn) as conn,
        pytest.raises(UnsupportedConnection, match=r"^conn: Connection is synchronous: use `enqueue"),
    ):
        asyncio.run(outbox.enqueue_async(conn, "t", b"x"))

    async def sync_on_async() -> None:
        aconn = await psycopg.AsyncConnection.connect(pg_dsn)
        try:
            with pytest.raises(UnsupportedConnection, match=r"^conn: AsyncConnection is asynchronous"):
                outbox.enqueue(aconn, "t", b"x")
        finally:
            await aconn.close()

    asyncio.run(sync_on_async())
    with pytest.raises(TypeError):  # UnsupportedConnection is a TypeError: existing handlers catch it
        outbox.enqueue(object(), "t", b"x")  # type: ignore[arg-type]


# -- the fast path of enqueue_many, per driver ---------------------------------------------


def _many(topic: str, n: int = 1000) -> list[dict[str, Any]]:
    return [{"topic": topic, "key": f"k{i % 10}", "payload": {"i": i}} for i in range(n)]


def test_psycopg_enqueue_many_is_one_binary_copy(pg_dsn: str, schema: str) -> None:
    statements: list[str] = []

    class Counting(psycopg.Cursor[Any]):
        def execute(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append("execute")
            return super().execute(query, *args, **kwargs)

        def executemany(self, query: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append("executemany")
            return super().executemany(query, *args, **kwargs)

        def copy(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
            statements.append("copy")
            return super().copy(statement, *args, **kwargs)

    with psycopg.connect(pg_dsn, cursor_factory=Counting) as conn:
        outbox.enqueue(conn, "warm", b"x", schema=schema)  # the schema check, once per connection
        statements.clear()
        outbox.enqueue_many(conn, _many("t"), schema=schema)
        conn.commit()
    assert statements == ["copy"]
    assert count(pg_dsn, schema, "events") == 1001


def test_psycopg2_enqueue_many_is_one_copy_or_one_insert_and_round_trips(pg_dsn: str, schema: str) -> None:
    """Without delays: one COPY (text format); with a delay: one INSERT over arrays. Values
    that COPY's text format must escape (tabs, line breaks, backslashes, bytes that are not
    text) arrive exactly as psycopg 3 writes them."""
    import psycopg2
    import psycopg2.extensions

    calls: list[str] = []

    class Counting(psycopg2.extensions.cursor):
        def execute(self, query: Any, vars: Any = None) -> Any:
            calls.append(str(query).split()[0])
            return super().execute(query, vars)

        def copy_expert(self, sql: Any, file: Any, size: int = 8192) -> Any:
            calls.append("COPY")
            return super().copy_expert(sql, file, size)

    tricky = [
        {
            "topic": "t\tab",
            "key": b"\x00\xff\t",
            "payload": b"\x00bin\n",
            "headers": {"h": "a\tb\\c\nd", "b": b"\xff"},
        },
        {"topic": "t", "key": None, "payload": {"text": "line\nbreak \\ back"}},
        {"topic": "t", "key": "k", "payload": "plain"},
    ]
    conn = psycopg2.connect(pg_dsn, cursor_factory=Counting)
    try:
        outbox.enqueue(conn, "warm", b"x", schema=schema)
        calls.clear()
        outbox.enqueue_many(conn, _many("t"), schema=schema)
        assert calls == ["COPY"]
        calls.clear()
        outbox.enqueue_many(conn, [*_many("t", 10), {"topic": "t", "payload": 1, "delay": 60}], schema=schema)
        assert calls == ["INSERT"]
        two = outbox.enqueue_many(conn, tricky, schema=schema)
        conn.commit()
    finally:
        conn.close()
    with psycopg.connect(pg_dsn) as pconn:
        one = outbox.enqueue_many(pconn, tricky, schema=schema)
        pconn.commit()
        table = sql.SQL(
            "SELECT topic, key, payload, headers FROM {}.events WHERE event_id = ANY(%s) ORDER BY id"
        )
        rows = pconn.execute(table.format(sql.Identifier(schema)), (two,)).fetchall()
        reference = pconn.execute(table.format(sql.Identifier(schema)), (one,)).fetchall()
    assert rows == reference and len(rows) == 3
    assert rows[0][:3] == ("t\tab", b"\x00\xff\t", b"\x00bin\n")
    assert count(pg_dsn, schema, "events") == 1 + 1000 + 11 + 6


def test_asyncpg_enqueue_many_is_one_copy(pg_dsn: str, schema: str) -> None:
    """asyncpg's query logger sees every statement run through its statement API but COPY: a
    thousand events through enqueue_many arrive with no such statement at all."""
    import asyncpg

    from tests.stacks import url

    async def scenario() -> list[str]:
        seen: list[str] = []
        conn = await asyncpg.connect(url(pg_dsn, ""))
        try:
            async with conn.transaction():
                await outbox.enqueue_async(conn, "warm", b"x", schema=schema)  # the schema check
            conn.add_query_logger(lambda record: seen.append(record.query))
            async with conn.transaction():
                await outbox.enqueue_many_async(conn, _many("t"), schema=schema)
        finally:
            await conn.close()
        return [q for q in seen if not q.startswith(("BEGIN", "COMMIT"))]

    assert asyncio.run(scenario()) == []
    assert count(pg_dsn, schema, "events") == 1001


# What the tests below ask the server: the named prepared statements of the session, less the
# one asking (which the driver may itself prepare).
PREPARED = "SELECT name, statement FROM pg_prepared_statements WHERE statement NOT LIKE '%pg_prepared%'"


def _writes(n: int = 6) -> list[tuple[str, list[dict[str, Any]]]]:
    """Every kind of write, each more often than a driver's prepare threshold."""
    delayed = [{"topic": "d", "payload": {"i": i}, "key": "k", "delay": 30} for i in range(3)]
    return [("one", []), ("many", _many("m", 20)), ("delayed", delayed)] * n


def test_psycopg_writes_prepare_nothing_whatever_the_threshold(pg_dsn: str, schema: str) -> None:
    """PgBouncer in transaction mode runs each transaction on whichever server connection is
    free: a prepared statement is not there. psycopg 3 prepares what runs prepare_threshold
    times; at 0 it prepares every statement at once. The outbox's own prepare none."""
    with psycopg.connect(pg_dsn, prepare_threshold=0) as conn:
        for kind, events in _writes():
            with conn.transaction():
                if kind == "one":
                    outbox.enqueue(conn, "one", {"a": 1}, key="k", schema=schema)
                else:
                    outbox.enqueue_many(conn, events, schema=schema)
                assert outbox.inbox.first_delivery(conn, "c", uuid.uuid4(), schema=schema)
        assert conn.execute(PREPARED).fetchall() == []
        conn.execute("SELECT %s::int", (1,))  # the check itself: this one is prepared
        assert [r[1] for r in conn.execute(PREPARED.replace("NOT LIKE", "NOT ILIKE")).fetchall()] == [
            "SELECT $1::int"
        ]


def test_asyncpg_writes_prepare_nothing_named_whatever_the_cache(pg_dsn: str, schema: str) -> None:
    """asyncpg's statement cache (on by default) names every statement it prepares; with
    statement_cache_size=0 it prepares them unnamed. The outbox's own are unnamed either way."""
    import asyncpg

    from tests.stacks import url

    async def scenario() -> tuple[list[Any], list[Any]]:
        conn = await asyncpg.connect(url(pg_dsn, ""))  # the default cache
        try:
            for kind, events in _writes():
                async with conn.transaction():
                    if kind == "one":
                        await outbox.enqueue_async(conn, "one", {"a": 1}, key="k", schema=schema)
                    else:
                        await outbox.enqueue_many_async(conn, events, schema=schema)
                    assert await outbox.inbox.first_delivery_async(conn, "c", uuid.uuid4(), schema=schema)
            ours = await conn.fetch(PREPARED)
            await conn.fetchval("SELECT $1::int", 1)  # the check itself: the cache names this one
            app = await conn.fetch(PREPARED)
        finally:
            await conn.close()
        return [tuple(r) for r in ours], [r[1] for r in app]

    ours, app = asyncio.run(scenario())
    assert ours == []
    assert app == ["SELECT $1::int"]
    assert count(pg_dsn, schema, "events") == 6 * (1 + 20 + 3)


# -- the pytest plugin sees every stack --------------------------------------------------


@pytest.mark.parametrize("name", SYNC_STACKS)
def test_outbox_events_fixture_records_sync_stacks(
    name: str, pg_dsn: str, schema: str, outbox_events: Any
) -> None:
    if name == "django":
        configure_django(pg_dsn, "outbox")
    stack = SyncStack(name, pg_dsn)
    try:
        with stack.tx() as c:
            outbox.enqueue(
                c, "orders.created", {"sku": "a-1"}, key="a-1", headers={"tenant": "t1"}, schema=schema
            )
            outbox.enqueue_many(
                c, [{"topic": "orders.paid", "key": b"\xff", "payload": b"raw"}], schema=schema
            )
    finally:
        stack.close()
    event = outbox_events.assert_enqueued("orders.created", key="a-1", payload={"sku": "a-1"})
    assert event.headers == {"tenant": "t1", "content-type": "application/json"} and event.schema == schema
    assert outbox_events.assert_enqueued("orders.paid").key == b"\xff"
    assert len(outbox_events) == 2


@pytest.mark.parametrize("name", ASYNC_STACKS)
def test_outbox_events_fixture_records_async_stacks(
    name: str, pg_dsn: str, schema: str, outbox_events: Any
) -> None:
    stack = AsyncStack(name, pg_dsn)

    async def scenario() -> None:
        async with stack.connection() as conn, stack.tx(conn) as c:
            await outbox.enqueue_async(c, "orders.created", {"sku": "a-1"}, key="a-1", schema=schema)
            await outbox.enqueue_many_async(c, [{"topic": "orders.paid", "payload": "paid"}], schema=schema)

    asyncio.run(scenario())
    assert outbox_events.assert_enqueued("orders.created", key="a-1").payload == {"sku": "a-1"}
    assert outbox_events.assert_enqueued("orders.paid").payload == b"paid"
