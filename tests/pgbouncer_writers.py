"""An app writing through PgBouncer in transaction mode: THREADS connections of one stack, each
doing TRANSACTIONS transactions of "insert an order + enqueue its event", with the setting
docs/writers.md ("Behind PgBouncer") gives for that stack. Run as a process of its own (Django
is configured once per process):

    python -m tests.pgbouncer_writers STACK DSN SCHEMA TOPIC TRANSACTIONS THREADS

Prints the committed event ids as one JSON list; any error fails the process.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from typing import Any

from psycopg import sql

import outbox
from tests.stacks import url

SYNC = ["psycopg", "psycopg2", "sqlalchemy-psycopg", "sqlalchemy-psycopg2", "django"]
ASYNC = ["psycopg-async", "asyncpg", "sqlalchemy-async-asyncpg", "sqlalchemy-async-psycopg"]
STACKS = SYNC + ASYNC


def _order(schema: str) -> str:
    return sql.SQL("INSERT INTO {}.orders (n) VALUES (%s)").format(sql.Identifier(schema)).as_string()


def sync_writer(stack: str, dsn: str, schema: str, topic: str, n: int, thread: int) -> list[str]:
    ids: list[str] = []
    order = _order(schema)

    def write(conn: Any, cursor: Any, i: int) -> None:
        cursor(order, (i,))
        ids.append(
            str(outbox.enqueue(conn, topic, {"order": i, "thread": thread}, key=f"k{i % 50}", schema=schema))
        )

    if stack == "psycopg":
        import psycopg

        with psycopg.connect(dsn, prepare_threshold=None) as conn:
            for i in range(n):
                with conn.transaction():
                    write(conn, conn.execute, i)
    elif stack == "psycopg2":
        import psycopg2

        conn = psycopg2.connect(dsn)
        try:
            for i in range(n):
                with conn.cursor() as cur:
                    write(conn, cur.execute, i)
                conn.commit()
        finally:
            conn.close()
    elif stack.startswith("sqlalchemy-"):
        from sqlalchemy import create_engine, text
        from sqlalchemy.orm import Session

        driver = stack.split("-")[1]
        engine = create_engine(
            url(dsn, driver), connect_args={"prepare_threshold": None} if driver == "psycopg" else {}
        )
        statement = text(order.replace("%s", ":n"))
        try:
            with Session(engine) as session:
                for i in range(n):
                    write(session, lambda _q, p, s=session: s.execute(statement, {"n": p[0]}), i)
                    session.commit()
        finally:
            engine.dispose()
    elif stack == "django":
        from django.db import connection, transaction

        try:
            for i in range(n):
                with transaction.atomic(), connection.cursor() as cur:
                    write(connection, cur.execute, i)
        finally:
            connection.close()
    else:
        raise ValueError(stack)
    return ids


async def async_writer(stack: str, dsn: str, schema: str, topic: str, n: int, thread: int) -> list[str]:
    ids: list[str] = []
    order = _order(schema)

    async def write(conn: Any, i: int) -> None:
        event = {"order": i, "thread": thread}
        ids.append(str(await outbox.enqueue_async(conn, topic, event, key=f"k{i % 50}", schema=schema)))

    if stack == "psycopg-async":
        import psycopg

        async with await psycopg.AsyncConnection.connect(dsn, prepare_threshold=None) as conn:
            for i in range(n):
                async with conn.transaction():
                    await conn.execute(order, (i,))
                    await write(conn, i)
    elif stack == "asyncpg":
        import asyncpg

        pool = await asyncpg.create_pool(url(dsn, ""), min_size=1, max_size=1, statement_cache_size=0)
        try:
            async with pool.acquire() as conn:
                for i in range(n):
                    async with conn.transaction():
                        await conn.execute(order.replace("%s", "$1"), i)
                        await write(conn, i)
        finally:
            await pool.close()
    elif stack.startswith("sqlalchemy-async-"):
        from sqlalchemy import text
        from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

        driver = stack.rsplit("-", 1)[1]
        args = (
            {"statement_cache_size": 0, "prepared_statement_cache_size": 0}
            if driver == "asyncpg"
            else {"prepare_threshold": None}
        )
        engine = create_async_engine(url(dsn, driver), connect_args=args)
        statement = text(order.replace("%s", ":n"))
        try:
            async with AsyncSession(engine) as session:
                for i in range(n):
                    await session.execute(statement, {"n": i})
                    await write(session, i)
                    await session.commit()
        finally:
            await engine.dispose()
    else:
        raise ValueError(stack)
    return ids


def main() -> None:
    stack, dsn, schema, topic, n, threads = sys.argv[1:7]
    if stack == "django":
        _configure_django(dsn)
    results: list[list[str]] = [[] for _ in range(int(threads))]
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            if stack in SYNC:
                results[t] = sync_writer(stack, dsn, schema, topic, int(n), t)
            else:
                results[t] = asyncio.run(async_writer(stack, dsn, schema, topic, int(n), t))
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=run, args=(t,)) for t in range(int(threads))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    if errors:
        raise errors[0]
    print(json.dumps([i for r in results for i in r]))


def _configure_django(dsn: str) -> None:
    """docs/writers.md's settings: no server-side cursors; on psycopg 3, no prepared statements."""
    from django.db.backends.postgresql.psycopg_any import is_psycopg3
    from outbox_bench.writers import configure_django

    options = {"prepare_threshold": None} if is_psycopg3 else {}
    configure_django(dsn, {"DISABLE_SERVER_SIDE_CURSORS": True, "OPTIONS": options})


if __name__ == "__main__":
    main()
