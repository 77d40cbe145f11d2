"""The ``writer`` scenario: what ``enqueue`` adds to an app's transaction, on every stack.

For each stack (psycopg 3, psycopg2, SQLAlchemy Session on psycopg 3, Django on its
default backend, asyncpg from a pool, SQLAlchemy AsyncSession on asyncpg, psycopg 3
async), written the way an app writes:

- the business transaction: insert an order row, commit;
- the same with ``enqueue`` of one realistic event (a JSON order, its key) before the commit;

interleaved pair by pair so that drift hits both alike, with the NOTIFY trigger on
(the default) and off. Reported: p50 and p99 of each, the p50 overhead, and
``enqueue_many`` of 1,000 events (call + commit). A stack whose package is not installed
is skipped with one line naming its extra.
"""

from __future__ import annotations

import asyncio
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox import capture
from outbox.extras import missing
from outbox.harness.load import prepare
from outbox.observe.progress import Progress
from outbox.store.migrate import migrate
from outbox.write.writer import enqueue, enqueue_async, enqueue_many, enqueue_many_async
from outbox_bench.config import BenchConfig
from outbox_bench.measure import percentiles
from outbox_bench.queries import query

KEYS = 1000
MANY = 1000

# stack -> the extras it needs (outbox.extras knows their packages)
STACKS: dict[str, tuple[str, ...]] = {
    "psycopg": (),
    "psycopg2": ("psycopg2",),
    "sqlalchemy": ("sqlalchemy",),
    "django": ("django",),
    "asyncpg": ("asyncpg",),
    "sqlalchemy-async": ("sqlalchemy", "asyncpg"),
    "psycopg-async": (),
}


def event(i: int) -> dict[str, Any]:
    """A realistic event: an order as JSON, keyed by its customer."""
    return {
        "topic": "orders.created",
        "key": f"customer-{i % KEYS}",
        "payload": {
            "order_id": i,
            "customer": f"customer-{i % KEYS}",
            "items": [{"sku": f"sku-{i % 97}", "qty": 1 + i % 3, "price": "19.99"}],
            "total": "19.99",
            "currency": "EUR",
        },
    }


def sqlalchemy_url(dsn: str, driver: str) -> str:
    """A libpq DSN as a URL: ``postgresql+<driver>://…`` (SQLAlchemy), or ``postgresql://…``."""
    p = conninfo_to_dict(dsn)
    auth = str(p.get("user", "")) + (f":{p['password']}" if p.get("password") else "")
    scheme = f"postgresql+{driver}" if driver else "postgresql"
    host = str(p.get("host", "127.0.0.1"))
    if host.startswith("/"):  # a socket directory (the embedded PostgreSQL): a query parameter
        query = urllib.parse.urlencode({"host": host, "port": p.get("port", 5432)})
        return f"{scheme}://{auth}@/{p.get('dbname', '')}?{query}"
    return f"{scheme}://{auth}@{host}:{p.get('port', 5432)}/{p.get('dbname', '')}"


class SyncStack:
    """``tx(i, with_event)`` runs one business transaction; ``many(events)`` one enqueue_many + commit."""

    def __init__(self, name: str, dsn: str, schema: str) -> None:
        self.name, self.schema = name, schema
        self._close: list[Callable[[], Any]] = []
        insert = query("harness_insert_order", schema)
        if name == "psycopg":
            conn = psycopg.connect(dsn)
            self._close.append(conn.close)

            def tx(i: int, with_event: bool) -> None:
                with conn.transaction():
                    conn.execute(insert, (f"customer-{i % KEYS}", i, 100))
                    if with_event:
                        enqueue(conn, **event(i), schema=schema)

            def many(events: list[dict[str, Any]]) -> None:
                with conn.transaction():
                    enqueue_many(conn, events, schema=schema)

        elif name == "psycopg2":
            import psycopg2

            raw = psycopg2.connect(dsn)
            self._close.append(raw.close)
            text = insert.as_string()

            def tx(i: int, with_event: bool) -> None:
                with raw.cursor() as cur:
                    cur.execute(text, (f"customer-{i % KEYS}", i, 100))
                    if with_event:
                        enqueue(cur, **event(i), schema=schema)
                raw.commit()

            def many(events: list[dict[str, Any]]) -> None:
                enqueue_many(raw, events, schema=schema)
                raw.commit()

        elif name == "sqlalchemy":
            from sqlalchemy import create_engine
            from sqlalchemy import text as sa_text
            from sqlalchemy.orm import Session

            engine = create_engine(sqlalchemy_url(dsn, "psycopg"))
            session = Session(engine)
            self._close += [session.close, engine.dispose]
            statement = sa_text(query("harness_insert_order_named", schema).as_string())

            def tx(i: int, with_event: bool) -> None:
                session.execute(statement, {"key": f"customer-{i % KEYS}", "seq": i, "amount": 100})
                if with_event:
                    enqueue(session, **event(i), schema=schema)
                session.commit()

            def many(events: list[dict[str, Any]]) -> None:
                enqueue_many(session, events, schema=schema)
                session.commit()

        elif name == "django":
            configure_django(dsn)
            from django.db import connection, transaction

            text = insert.as_string()

            def tx(i: int, with_event: bool) -> None:
                with transaction.atomic():
                    with connection.cursor() as cur:
                        cur.execute(text, (f"customer-{i % KEYS}", i, 100))
                    if with_event:
                        enqueue(connection, **event(i), schema=schema)

            def many(events: list[dict[str, Any]]) -> None:
                with transaction.atomic():
                    enqueue_many(connection, events, schema=schema)

            self._close.append(connection.close)
        else:
            raise ValueError(name)
        self.tx, self.many = tx, many

    def close(self) -> None:
        for close in self._close:
            close()


AsyncTx = Callable[[int, bool], Coroutine[Any, Any, None]]
AsyncMany = Callable[[list[dict[str, Any]]], Coroutine[Any, Any, None]]


async def async_stack(name: str, dsn: str, schema: str) -> tuple[AsyncTx, AsyncMany, Callable[[], Any]]:
    """(``tx``, ``many``, ``close``) for an async stack, as :class:`SyncStack` has them."""
    if name == "asyncpg":
        import asyncpg

        pool = await asyncpg.create_pool(sqlalchemy_url(dsn, ""), min_size=1, max_size=1)
        text = query("harness_insert_order_numbered", schema).as_string()

        async def tx(i: int, with_event: bool) -> None:
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute(text, f"customer-{i % KEYS}", i, 100)
                if with_event:
                    await enqueue_async(conn, **event(i), schema=schema)

        async def many(events: list[dict[str, Any]]) -> None:
            async with pool.acquire() as conn, conn.transaction():
                await enqueue_many_async(conn, events, schema=schema)

        return tx, many, pool.close
    if name == "sqlalchemy-async":
        from sqlalchemy import text as sa_text
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        engine = create_async_engine(sqlalchemy_url(dsn, "asyncpg"))
        session = AsyncSession(engine)
        statement = sa_text(query("harness_insert_order_named", schema).as_string())

        async def tx(i: int, with_event: bool) -> None:
            await session.execute(statement, {"key": f"customer-{i % KEYS}", "seq": i, "amount": 100})
            if with_event:
                await enqueue_async(session, **event(i), schema=schema)
            await session.commit()

        async def many(events: list[dict[str, Any]]) -> None:
            await enqueue_many_async(session, events, schema=schema)
            await session.commit()

        async def close() -> None:
            await session.close()
            await engine.dispose()

        return tx, many, close
    if name == "psycopg-async":
        conn = await psycopg.AsyncConnection.connect(dsn)
        insert = query("harness_insert_order", schema)

        async def tx(i: int, with_event: bool) -> None:
            async with conn.transaction():
                await conn.execute(insert, (f"customer-{i % KEYS}", i, 100))
                if with_event:
                    await enqueue_async(conn, **event(i), schema=schema)

        async def many(events: list[dict[str, Any]]) -> None:
            async with conn.transaction():
                await enqueue_many_async(conn, events, schema=schema)

        return tx, many, conn.close
    raise ValueError(name)


def configure_django(dsn: str, database: dict[str, Any] | None = None, **extra: Any) -> None:
    """Django settings for ``dsn`` (``database``: more keys of its DATABASES entry; plus
    ``extra`` settings), once per process."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    p = conninfo_to_dict(dsn)
    settings.configure(
        DATABASES={
            "default": {
                "ENGINE": "django.db.backends.postgresql",
                "NAME": p.get("dbname", ""),
                "USER": p.get("user", ""),
                "PASSWORD": p.get("password", ""),
                "HOST": p.get("host", ""),
                "PORT": str(p.get("port", "")),
                **(database or {}),
            }
        },
        USE_TZ=True,
        **extra,
    )
    django.setup()


def _missing(name: str) -> str | None:
    extras = STACKS[name]
    if not any(missing(extra) for extra in extras):
        return None
    return f"pip install 'outbox-relay[{','.join(extras)}]'"


def _summary(plain: list[float], with_event: list[float]) -> dict[str, Any]:
    p_plain, p_event = percentiles(plain), percentiles(with_event)
    return {
        "business_tx_ms": p_plain,
        "business_tx_with_enqueue_ms": p_event,
        "enqueue_overhead_p50_ms": round((p_event["p50"] or 0) - (p_plain["p50"] or 0), 3),
    }


def _set_notify(dsn: str, schema: str, on: bool) -> None:
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute(query("notify_trigger", schema, keywords={"state": "ENABLE" if on else "DISABLE"}))


def _measure_sync(
    cfg: BenchConfig, name: str, schema: str, notifies: tuple[bool, ...] = (True, False)
) -> dict[str, Any]:
    stack = SyncStack(name, cfg.dsn, schema)
    out: dict[str, Any] = {}
    try:
        stack.tx(0, True)  # warm: connections, the schema check, prepared plans
        for notify in notifies:
            _set_notify(cfg.dsn, schema, notify)
            plain: list[float] = []
            with_event: list[float] = []
            progress = Progress(
                f"writer {name} notify={'on' if notify else 'off'}", cfg.writer_iterations, " tx"
            )
            for i in range(cfg.writer_iterations):
                t0 = time.perf_counter()
                stack.tx(i, False)
                t1 = time.perf_counter()
                stack.tx(i, True)
                t2 = time.perf_counter()
                plain.append((t1 - t0) * 1000)
                with_event.append((t2 - t1) * 1000)
                if i % 100 == 0:
                    progress.update(i)
            progress.close()
            out[f"notify_{'on' if notify else 'off'}"] = _summary(plain, with_event)
        _set_notify(cfg.dsn, schema, True)
        many: list[float] = []
        for r in range(cfg.enqueue_many_repeats):
            events = [event(r * MANY + i) for i in range(MANY)]
            t0 = time.perf_counter()
            stack.many(events)
            many.append((time.perf_counter() - t0) * 1000)
        out["enqueue_many_1000_ms"] = percentiles(many)
    finally:
        stack.close()
    return out


async def _measure_async(
    cfg: BenchConfig, name: str, schema: str, notifies: tuple[bool, ...] = (True, False)
) -> dict[str, Any]:
    # The same loop as _measure_sync, timed inside the event loop. One function for both
    # would need the sync stacks inside a loop too, which Django refuses (it raises
    # SynchronousOnlyOperation), or every async transaction through run_until_complete.
    tx, many_tx, close = await async_stack(name, cfg.dsn, schema)
    out: dict[str, Any] = {}
    try:
        await tx(0, True)
        for notify in notifies:
            _set_notify(cfg.dsn, schema, notify)
            plain: list[float] = []
            with_event: list[float] = []
            progress = Progress(
                f"writer {name} notify={'on' if notify else 'off'}", cfg.writer_iterations, " tx"
            )
            for i in range(cfg.writer_iterations):
                t0 = time.perf_counter()
                await tx(i, False)
                t1 = time.perf_counter()
                await tx(i, True)
                t2 = time.perf_counter()
                plain.append((t1 - t0) * 1000)
                with_event.append((t2 - t1) * 1000)
                if i % 100 == 0:
                    progress.update(i)
            progress.close()
            out[f"notify_{'on' if notify else 'off'}"] = _summary(plain, with_event)
        _set_notify(cfg.dsn, schema, True)
        many: list[float] = []
        for r in range(cfg.enqueue_many_repeats):
            events = [event(r * MANY + i) for i in range(MANY)]
            t0 = time.perf_counter()
            await many_tx(events)
            many.append((time.perf_counter() - t0) * 1000)
        out["enqueue_many_1000_ms"] = percentiles(many)
    finally:
        await close()
    return out


def writer(cfg: BenchConfig) -> dict[str, Any]:
    """Every installed stack, one after the other, each on a fresh schema."""
    import uuid

    results: dict[str, Any] = {"iterations": cfg.writer_iterations, "stacks": {}, "skipped": {}}
    with psycopg.connect(cfg.dsn) as conn:
        level = conn.execute(query("wal_level", "public")).fetchone()
    wal = bool(level and level[0] == "logical" and int(level[1]) >= capture.MIN_SERVER)
    if wal:
        results["stacks_wal"] = {}  # the same stacks, the outbox in WAL capture (issue 30)
    for name in STACKS:
        missing = _missing(name)
        if missing:
            print(f"writer: skipping {name}: {missing}")
            results["skipped"][name] = missing
            continue
        schema = f"bench_writer_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(cfg.dsn, autocommit=True) as conn:
            migrate(conn, schema)
        prepare(cfg.dsn, schema)
        is_async = name in ("asyncpg", "sqlalchemy-async", "psycopg-async")
        try:
            if is_async:
                results["stacks"][name] = asyncio.run(_measure_async(cfg, name, schema))
            else:
                results["stacks"][name] = _measure_sync(cfg, name, schema)
            if wal:
                # Fresh connections (each reads the mode once); NOTIFY plays no part (no row).
                with psycopg.connect(cfg.dsn, autocommit=True) as conn:
                    capture.switch(conn, schema, "wal")
                if is_async:
                    results["stacks_wal"][name] = asyncio.run(_measure_async(cfg, name, schema, (True,)))
                else:
                    results["stacks_wal"][name] = _measure_sync(cfg, name, schema, (True,))
        finally:
            with psycopg.connect(cfg.dsn, autocommit=True) as conn:
                if wal:
                    capture.switch(conn, schema, "table", drop_slot=True)
                conn.execute(query("harness_drop_schema", schema))
    return results
