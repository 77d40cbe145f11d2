"""Each database stack ``enqueue`` takes, driven the way an app drives it: a transaction
that commits, one that rolls back, a savepoint that rolls back.

Sync stacks: psycopg 3, psycopg2, SQLAlchemy (Session on psycopg 3, Connection on
psycopg2), Django (on the backend Django picks: psycopg 3 when it is installed).
Async stacks: psycopg 3, asyncpg (a pooled connection), SQLAlchemy AsyncSession on
asyncpg and AsyncConnection on psycopg 3.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import psycopg
import pytest
from outbox_bench.writers import sqlalchemy_url as url

SYNC_STACKS = [
    "psycopg",
    "psycopg2",
    "sqlalchemy-session-psycopg",
    "sqlalchemy-connection-psycopg2",
    "django",
]
ASYNC_STACKS = [
    "psycopg-async",
    "asyncpg-pool",
    "sqlalchemy-asyncsession-asyncpg",
    "sqlalchemy-asyncconnection-psycopg",
]


class SyncStack:
    """``tx()`` yields what the app passes to ``enqueue`` and commits at the end;
    ``rollback_tx()`` rolls back instead; ``savepoint()`` is a nested block rolled back."""

    def __init__(self, name: str, dsn: str) -> None:
        self.name = name
        self.dsn = dsn
        self._close: list[Any] = []
        if name == "psycopg":
            self.conn: Any = psycopg.connect(dsn)
            self._close.append(self.conn.close)
        elif name == "psycopg2":
            import psycopg2

            self.conn = psycopg2.connect(dsn)
            self._close.append(self.conn.close)
        elif name.startswith("sqlalchemy"):
            from sqlalchemy import create_engine
            from sqlalchemy.orm import Session

            engine = create_engine(url(dsn, name.rsplit("-", 1)[1]))
            self._close.append(engine.dispose)
            if "-session-" in name:
                self.conn = Session(engine)
            else:
                self.conn = engine.connect()
            self._close.insert(0, self.conn.close)
        elif name == "django":
            from django.db import connection

            self.conn = connection
        else:
            raise ValueError(name)

    @contextlib.contextmanager
    def tx(self) -> Iterator[Any]:
        if self.name == "psycopg":
            with self.conn.transaction():
                yield self.conn
        elif self.name == "django":
            from django.db import transaction

            with transaction.atomic():
                yield self.conn
        else:
            try:
                yield self.conn
            except BaseException:
                self.conn.rollback()
                raise
            self.conn.commit()

    @contextlib.contextmanager
    def rollback_tx(self) -> Iterator[Any]:
        if self.name == "psycopg":
            with self.conn.transaction(force_rollback=True):
                yield self.conn
        elif self.name == "django":
            from django.db import transaction

            with transaction.atomic():
                yield self.conn
                transaction.set_rollback(True)
        else:
            yield self.conn
            self.conn.rollback()

    @contextlib.contextmanager
    def savepoint(self) -> Iterator[None]:
        if self.name == "psycopg":
            with self.conn.transaction(force_rollback=True):
                yield
        elif self.name == "psycopg2":
            with self.conn.cursor() as cur:
                cur.execute("SAVEPOINT app")
                yield
                cur.execute("ROLLBACK TO SAVEPOINT app")
        elif self.name.startswith("sqlalchemy"):
            nested = self.conn.begin_nested()
            yield
            nested.rollback()
        else:
            from django.db import transaction

            with transaction.atomic():
                yield
                transaction.set_rollback(True)

    def close(self) -> None:
        for close in self._close:
            close()


class AsyncStack:
    def __init__(self, name: str, dsn: str) -> None:
        self.name = name
        self.dsn = dsn

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Any]:
        """A connection (session) of this stack, closed at the end."""
        if self.name == "psycopg-async":
            conn = await psycopg.AsyncConnection.connect(self.dsn)
            try:
                yield conn
            finally:
                await conn.close()
        elif self.name == "asyncpg-pool":
            import asyncpg

            pool = await asyncpg.create_pool(url(self.dsn, ""), min_size=1, max_size=1)
            try:
                async with pool.acquire() as conn:
                    yield conn
            finally:
                await pool.close()
        else:
            from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

            engine = create_async_engine(url(self.dsn, self.name.rsplit("-", 1)[1]))
            try:
                if "-asyncsession-" in self.name:
                    async with AsyncSession(engine) as session:
                        yield session
                else:
                    async with engine.connect() as conn:
                        yield conn
            finally:
                await engine.dispose()

    @contextlib.asynccontextmanager
    async def tx(self, conn: Any, *, rollback: bool = False) -> AsyncIterator[Any]:
        """A transaction on ``conn``: committed at the end (rolled back with ``rollback``)."""
        if self.name == "psycopg-async":
            async with conn.transaction(force_rollback=rollback):
                yield conn
        elif self.name == "asyncpg-pool":
            tr = conn.transaction()
            await tr.start()
            try:
                yield conn
            except BaseException:
                await tr.rollback()
                raise
            await (tr.rollback() if rollback else tr.commit())
        else:
            try:
                yield conn
            except BaseException:
                await conn.rollback()
                raise
            await (conn.rollback() if rollback else conn.commit())

    @contextlib.asynccontextmanager
    async def savepoint(self, conn: Any) -> AsyncIterator[None]:
        if self.name == "psycopg-async":
            async with conn.transaction(force_rollback=True):
                yield
        elif self.name == "asyncpg-pool":
            tr = conn.transaction()  # nested in a transaction: a savepoint
            await tr.start()
            yield
            await tr.rollback()
        else:
            nested = await conn.begin_nested()
            yield
            await nested.rollback()


def configure_django(dsn: str, schema: str) -> None:
    """Django settings for the in-process tests (once per process), with the outbox app.

    Django 5 itself refuses servers older than PostgreSQL 14 (Django 4.2 takes 12+): on such a
    server (scripts/pg-matrix 13) the Django cases are skipped with that reason, not run."""
    import django
    from outbox_bench.writers import configure_django as configure

    with psycopg.connect(dsn) as conn:
        server = conn.info.server_version // 10000
    if django.VERSION >= (5, 0) and server < 14:
        pytest.skip(f"Django {django.__version__} requires PostgreSQL 14 or later (server is {server})")

    configure(dsn, INSTALLED_APPS=["outbox.contrib.django"], OUTBOX_SCHEMA=schema)
