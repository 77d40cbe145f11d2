"""The database stacks ``enqueue`` writes through, and how it writes on each.

Every stack comes down to one of four drivers' connections, in the caller's
transaction:

=====================  =========================================================
the caller passes      what ``enqueue`` writes on
=====================  =========================================================
psycopg 3              the connection (of a cursor: its connection)
psycopg2               the connection (of a cursor: its connection)
SQLAlchemy             the DBAPI connection under the ``Session``'s (or the
                       ``Connection``'s) current transaction: psycopg 3 or psycopg2
Django                 ``connection.connection``: psycopg 3 or psycopg2
asyncpg                the connection (also one acquired from a pool)
SQLAlchemy async       the driver connection under the ``AsyncSession``'s (or
                       ``AsyncConnection``'s) transaction: asyncpg or psycopg 3
=====================  =========================================================

A :class:`Writer` (sync) or :class:`AsyncWriter` knows one driver: how to tell
whether a transaction is open, how to insert one event, and its fast path for
many (binary COPY on psycopg 3, text COPY on psycopg2 and asyncpg; with delays,
one ``INSERT … SELECT FROM unnest(arrays)``). Validation and encoding happen once,
before, in :mod:`outbox.write.writer`, for every stack alike.

No statement of the outbox relies on a server-side prepared statement, whatever the
caller's connection is set to do, so that ``enqueue`` and ``first_delivery`` work behind
PgBouncer in transaction mode (where the next transaction may run on another server
connection, which never saw the statement): psycopg 3 executes with ``prepare=False``
(its ``executemany`` always prepares, so many delayed events go as one statement of
arrays); asyncpg prepares each statement *unnamed* (``prepare(name="")``, used at once in
the caller's transaction, which PgBouncer keeps on one server connection) instead of
through its statement cache, and writes many with ``COPY`` (``copy_records_to_table``
would prepare its introspection query through that cache); psycopg2 never prepares.

Optional packages are recognised by the module of the object's type, so the
core package imports none of them: an object from a package that is installed is
handled by importing it then.
"""

from __future__ import annotations

import functools
import io
import json
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import psycopg
from psycopg.pq import TransactionStatus
from psycopg.types.json import Jsonb

from outbox.capture import wal_message
from outbox.errors import NotMigrated, OutsideTransaction, UnsupportedConnection
from outbox.events import EncodedEvent
from outbox.store.queries import query, raw

SYNC_STACKS = (
    "a psycopg Connection or Cursor, a psycopg2 connection or cursor, an SQLAlchemy Session or "
    "Connection, or a Django connection"
)
ASYNC_STACKS = (
    "a psycopg AsyncConnection or AsyncCursor, an asyncpg Connection, or an SQLAlchemy "
    "AsyncSession or AsyncConnection"
)

COPY_COLUMNS = ("event_id", "topic", "key", "payload", "headers", "type", "subject")

# Schemas already known to hold an outbox, per driver connection. Checking costs a round
# trip, so it happens once per connection and schema; the check keeps an unknown schema
# from aborting the caller's transaction with UndefinedTable.
_known: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()


def _seen(raw: Any) -> set[str]:
    """The schemas known on ``raw`` (a set to add to; a throwaway one if it cannot be cached)."""
    # asyncpg's pool hands out a new proxy per acquire, which takes no weak reference: the
    # connection it wraps does, and lives as long as the pool keeps it.
    target = raw
    if not isinstance(raw, (psycopg.Connection, psycopg.AsyncConnection)) and _module(raw) == "asyncpg":
        target = getattr(raw, "_con", raw)
    try:
        return _known.setdefault(target, set())
    except TypeError:
        return set()  # checked every time rather than remembered under an id that may be reused


@functools.lru_cache(maxsize=256)
def _sql(name: str, schema: str) -> str:
    """The named statement with the schema bound (as an identifier), rendered once: psycopg
    would otherwise compose it again on every execute, a quarter of ``enqueue``'s own time."""
    return query(name, schema).as_string()


WAL = "wal:"  # in a connection's known set, before a schema: its outbox is in WAL capture


def _remember(seen: set[str], schema: str, mode: str | None) -> None:
    """Remember a schema's capture mode on a connection (``writer_capture``; None: no outbox)."""
    if mode is None:
        raise unknown_schema(schema)
    seen.add(schema)
    if mode == "wal":
        seen.add(WAL + schema)


def _emitted(events: Sequence[EncodedEvent]) -> tuple[list[bytes]]:
    """``emit_events``'s parameter: each event's content (the function signs it and adds the
    prefix and the creation time)."""
    return ([wal_message.encode(ev) for ev in events],)


def unknown_schema(schema: str) -> NotMigrated:
    return NotMigrated(f"schema: {schema!r} holds no outbox tables; run `outbox migrate --schema {schema}`")


def outside_transaction(stack: str, how: str) -> OutsideTransaction:
    return OutsideTransaction(
        f"conn: the {stack} connection is not in a transaction (autocommit), so the event (or the "
        f"inbox record) would commit on its own, apart from your data; {how}"
    )


def _params(ev: EncodedEvent) -> tuple[Any, ...]:
    return (
        ev.event_id, ev.topic, ev.key, ev.payload, Jsonb(ev.headers), ev.type, ev.subject, ev.delay,
        ev.expires_at,
    )  # fmt: skip


def _arrays(events: Sequence[EncodedEvent]) -> bool:
    """Whether ``events`` go as one statement of arrays, not COPY: some have a delay or an expiry
    (COPY writes neither available_at nor expires_at)."""
    return any(ev.delay or ev.expires_at is not None for ev in events)


COPY_TYPES = ["uuid", "text", "bytea", "bytea", "jsonb", "text", "text"]


def _copy_row(ev: EncodedEvent) -> tuple[Any, ...]:
    return (ev.event_id, ev.topic, ev.key, ev.payload, Jsonb(ev.headers), ev.type, ev.subject)


def _copy_nullable(value: str | None) -> str:
    """A nullable text column in COPY's text format."""
    return "\\N" if value is None else value.translate(_COPY_TEXT)


def _headers_json(ev: EncodedEvent) -> str:
    return json.dumps(ev.headers, separators=(",", ":"))


def _text_row(ev: EncodedEvent) -> tuple[Any, ...]:
    """An event as ``insert_events_arrays`` takes it, a value per column (psycopg 3, psycopg2)."""
    return (
        str(ev.event_id), ev.topic, ev.key, ev.payload, _headers_json(ev), ev.type, ev.subject, ev.delay,
        ev.expires_at,
    )  # fmt: skip


def _columns(events: Sequence[EncodedEvent]) -> list[list[Any]]:
    """``insert_events_arrays``'s parameters: one list per column, rows in order."""
    return [list(column) for column in zip(*map(_text_row, events), strict=True)]


def _copy_text(events: Sequence[EncodedEvent]) -> str:
    """Events without delay or expiry as ``COPY … FROM STDIN`` text (bytea as hex): psycopg2, asyncpg."""
    buffer = io.StringIO()
    write = buffer.write
    for ev in events:
        key = "\\N" if ev.key is None else "\\\\x" + ev.key.hex()
        write(
            f"{ev.event_id}\t{ev.topic.translate(_COPY_TEXT)}\t{key}\t\\\\x{ev.payload.hex()}\t"
            f"{_headers_json(ev).translate(_COPY_TEXT)}\t{_copy_nullable(ev.type)}\t{_copy_nullable(ev.subject)}\n"
        )
    return buffer.getvalue()


class Writer(Protocol):
    stack: str

    def require_transaction(self) -> None: ...
    def ensure_schema(self, schema: str) -> bool: ...
    def insert(self, schema: str, ev: EncodedEvent) -> None: ...
    def insert_many(self, schema: str, events: Sequence[EncodedEvent]) -> None: ...
    def emit(self, schema: str, events: Sequence[EncodedEvent]) -> None: ...
    def flag(self, name: str, schema: str, *params: Any) -> bool: ...


class AsyncWriter(Protocol):
    stack: str

    def require_transaction(self) -> None: ...
    async def ensure_schema(self, schema: str) -> bool: ...
    async def insert(self, schema: str, ev: EncodedEvent) -> None: ...
    async def insert_many(self, schema: str, events: Sequence[EncodedEvent]) -> None: ...
    async def emit(self, schema: str, events: Sequence[EncodedEvent]) -> None: ...
    async def flag(self, name: str, schema: str, *params: Any) -> bool: ...


# -- psycopg 3 ------------------------------------------------------------------------------


def _psycopg_in_transaction(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> bool:
    # Not in autocommit mode: the first statement opens a transaction, which the caller
    # commits. In autocommit mode: only inside ``conn.transaction()`` (or a BEGIN).
    return not conn.autocommit or conn.info.transaction_status != TransactionStatus.IDLE


class PsycopgWriter:
    def __init__(self, conn: psycopg.Connection[Any], stack: str = "psycopg") -> None:
        self.conn = conn
        self.stack = stack

    def require_transaction(self) -> None:
        if not _psycopg_in_transaction(self.conn):
            raise outside_transaction(self.stack, "write inside `with conn.transaction():`")

    def ensure_schema(self, schema: str) -> bool:
        seen = _seen(self.conn)
        if schema not in seen:
            with psycopg.Cursor(self.conn) as cur:
                row = cur.execute(_sql("writer_capture", schema), (schema, schema), prepare=False).fetchone()
                found = row[0] if row else None
                if found == "check":
                    mode = cur.execute(_sql("capture_mode", schema), prepare=False).fetchone()
                    found = mode[0] if mode else "table"
            _remember(seen, schema, found)
        return WAL + schema in seen

    def insert(self, schema: str, ev: EncodedEvent) -> None:
        # A server-side binding cursor whatever the connection's cursor_factory (Django's binds
        # on the client, slower per event: decision 0013); never prepared (PgBouncer).
        with psycopg.Cursor(self.conn) as cur:
            cur.execute(_sql("insert_event", schema), _params(ev), prepare=False)

    def insert_many(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        with self.conn.cursor() as cur:
            if _arrays(events):
                cur.execute(_sql("insert_events_arrays", schema), _columns(events), prepare=False)
                return
            with cur.copy(_sql("copy_events", schema)) as copy:
                copy.set_types(COPY_TYPES)
                for ev in events:
                    copy.write_row(_copy_row(ev))

    def emit(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        with psycopg.Cursor(self.conn) as cur:
            cur.execute(_sql("emit_events_binary", schema), _emitted(events), prepare=False)

    def flag(self, name: str, schema: str, *params: Any) -> bool:
        """Run the named statement; whether it returned a row whose first column is true."""
        with psycopg.Cursor(self.conn) as cur:
            row = cur.execute(_sql(name, schema), params, prepare=False).fetchone()
        return bool(row and row[0])


class AsyncPsycopgWriter:
    def __init__(self, conn: psycopg.AsyncConnection[Any], stack: str = "psycopg") -> None:
        self.conn = conn
        self.stack = stack

    def require_transaction(self) -> None:
        if not _psycopg_in_transaction(self.conn):
            raise outside_transaction(self.stack, "write inside `async with conn.transaction():`")

    async def ensure_schema(self, schema: str) -> bool:
        seen = _seen(self.conn)
        if schema not in seen:
            async with psycopg.AsyncCursor(self.conn) as cur:
                await cur.execute(_sql("writer_capture", schema), (schema, schema), prepare=False)
                row = await cur.fetchone()
                found = row[0] if row else None
                if found == "check":
                    await cur.execute(_sql("capture_mode", schema), prepare=False)
                    mode = await cur.fetchone()
                    found = mode[0] if mode else "table"
            _remember(seen, schema, found)
        return WAL + schema in seen

    async def insert(self, schema: str, ev: EncodedEvent) -> None:
        async with psycopg.AsyncCursor(self.conn) as cur:  # server-side binding, as above
            await cur.execute(_sql("insert_event", schema), _params(ev), prepare=False)

    async def insert_many(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        async with self.conn.cursor() as cur:
            if _arrays(events):
                await cur.execute(_sql("insert_events_arrays", schema), _columns(events), prepare=False)
                return
            async with cur.copy(_sql("copy_events", schema)) as copy:
                copy.set_types(COPY_TYPES)
                for ev in events:
                    await copy.write_row(_copy_row(ev))

    async def emit(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        async with psycopg.AsyncCursor(self.conn) as cur:
            await cur.execute(_sql("emit_events_binary", schema), _emitted(events), prepare=False)

    async def flag(self, name: str, schema: str, *params: Any) -> bool:
        async with psycopg.AsyncCursor(self.conn) as cur:
            await cur.execute(_sql(name, schema), params, prepare=False)
            row = await cur.fetchone()
        return bool(row and row[0])


# -- psycopg2 -------------------------------------------------------------------------------


# COPY's text format: a backslash, tab or line break inside a value is escaped.
_COPY_TEXT = str.maketrans({"\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"})


class Psycopg2Writer:
    """psycopg2: the same ``%s`` statements as psycopg 3, as text (psycopg2 binds on the
    client and never prepares). Many events: one ``COPY`` in text format (bytea as hex), the
    fastest of psycopg2's ways (decision 0013); with delays, one ``INSERT … SELECT FROM
    unnest(arrays)``."""

    def __init__(self, conn: Any, stack: str = "psycopg2") -> None:
        self.conn = conn
        self.stack = stack

    def require_transaction(self) -> None:
        import psycopg2.extensions as ext

        if self.conn.autocommit and self.conn.get_transaction_status() == ext.TRANSACTION_STATUS_IDLE:
            raise outside_transaction(self.stack, "turn autocommit off, or write inside a BEGIN")

    def ensure_schema(self, schema: str) -> bool:
        seen = _seen(self.conn)
        if schema not in seen:
            with self.conn.cursor() as cur:
                cur.execute(_sql("writer_capture", schema), (schema, schema))
                row = cur.fetchone()
                found = row[0] if row else None
                if found == "check":
                    cur.execute(_sql("capture_mode", schema))
                    mode = cur.fetchone()
                    found = mode[0] if mode else "table"
            _remember(seen, schema, found)
        return WAL + schema in seen

    def insert(self, schema: str, ev: EncodedEvent) -> None:
        with self.conn.cursor() as cur:
            cur.execute(_sql("insert_event", schema), _text_row(ev))

    def insert_many(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        with self.conn.cursor() as cur:
            if _arrays(events):
                cur.execute(_sql("insert_events_arrays", schema), _columns(events))
                return
            cur.copy_expert(_sql("copy_events_text", schema), io.StringIO(_copy_text(events)))

    def emit(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        with self.conn.cursor() as cur:
            cur.execute(_sql("emit_events", schema), _emitted(events))

    def flag(self, name: str, schema: str, *params: Any) -> bool:
        with self.conn.cursor() as cur:
            cur.execute(_sql(name, schema), params)
            row = cur.fetchone()
        return bool(row and row[0])


# -- asyncpg --------------------------------------------------------------------------------


async def _unnamed(conn: Any, statement: str) -> Any:
    """``statement`` prepared unnamed on an asyncpg connection, whatever its statement cache:
    a named one would stay behind on a server connection that PgBouncer (transaction mode)
    hands to another client, and a cached one be looked for on the wrong one."""
    return await conn.prepare(statement, name="")


class AsyncpgWriter:
    """asyncpg: numbered parameters, unnamed statements; many events with ``COPY`` in text."""

    def __init__(self, conn: Any, stack: str = "asyncpg") -> None:
        self.conn = conn
        self.stack = stack

    def require_transaction(self) -> None:
        if not self.conn.is_in_transaction():
            raise outside_transaction(self.stack, "write inside `async with conn.transaction():`")

    async def ensure_schema(self, schema: str) -> bool:
        seen = _seen(self.conn)
        if schema not in seen:
            found = await (await _unnamed(self.conn, _sql("writer_capture_numbered", schema))).fetchval(
                schema
            )
            if found == "check":
                found = await (await _unnamed(self.conn, _sql("capture_mode", schema))).fetchval() or "table"
            _remember(seen, schema, found)
        return WAL + schema in seen

    @staticmethod
    def _row(ev: EncodedEvent) -> tuple[Any, ...]:
        return (
            ev.event_id,
            ev.topic,
            ev.key,
            ev.payload,
            _headers_json(ev),
            ev.type,
            ev.subject,
            float(ev.delay),
            ev.expires_at,
        )

    async def insert(self, schema: str, ev: EncodedEvent) -> None:
        await (await _unnamed(self.conn, _sql("insert_event_numbered", schema))).fetch(*self._row(ev))

    async def insert_many(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        if _arrays(events):
            rows = [
                (str(e.event_id), e.topic, e.key and e.key.hex(), e.payload.hex(), _headers_json(e), e.type,
                 e.subject, str(e.delay), None if e.expires_at is None else repr(e.expires_at))
                for e in events
            ]  # fmt: skip
            columns = [list(column) for column in zip(*rows, strict=True)]
            await (await _unnamed(self.conn, _sql("insert_events_arrays_numbered", schema))).fetch(*columns)
            return
        await self.conn.copy_to_table(
            "events",
            schema_name=schema,
            columns=COPY_COLUMNS,
            source=io.BytesIO(_copy_text(events).encode()),
        )

    async def emit(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        (messages,) = _emitted(events)
        statement = await _unnamed(self.conn, _sql("emit_events_numbered", schema))
        await statement.fetch([m.hex() for m in messages])

    async def flag(self, name: str, schema: str, *params: Any) -> bool:
        return bool(await (await _unnamed(self.conn, _sql(name + "_numbered", schema))).fetchval(*params))


# -- which stack ----------------------------------------------------------------------------


_PACKAGES = ("psycopg2", "sqlalchemy", "django", "asyncpg")


def _module(obj: object) -> str:
    """The optional package ``obj``'s class comes from (or a subclass of one of its classes:
    an app's own ``Session`` subclass), else its own top-level module."""
    for cls in type(obj).__mro__:
        top = cls.__module__.split(".", 1)[0]
        if top in _PACKAGES:
            return top
    return type(obj).__module__.split(".", 1)[0]


def _sqlalchemy_dbapi(obj: Any) -> Any | None:
    """The DBAPI connection under an SQLAlchemy Session or Connection, in its transaction."""
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    if isinstance(obj, Session):
        obj = obj.connection()  # the connection of the session's transaction (begun if none)
    if not isinstance(obj, Connection):
        return None
    if not obj.in_transaction():
        obj.begin()  # what SQLAlchemy's autobegin does on the first statement; the caller commits
    return obj.connection.driver_connection


def _driver_writer(raw: Any, stack: str) -> Writer | None:
    if isinstance(raw, psycopg.Connection):
        return PsycopgWriter(raw, stack)
    if _module(raw) == "psycopg2":
        return Psycopg2Writer(raw, stack)
    return None


def writer_for(conn: object) -> Writer:
    """The sync writer for what the caller passed, or UnsupportedConnection listing what works."""
    if isinstance(conn, psycopg.Connection):
        return PsycopgWriter(conn)
    if isinstance(conn, psycopg.Cursor):
        return PsycopgWriter(conn.connection)
    module = _module(conn)
    found: Writer | None = None
    if module == "psycopg2":
        raw = getattr(conn, "connection", conn)  # a cursor's connection
        found = Psycopg2Writer(raw)
    elif module == "sqlalchemy":
        raw = _sqlalchemy_dbapi(conn)
        if raw is not None:
            found = _driver_writer(raw, f"SQLAlchemy ({_module(raw)})")
    elif module == "django" and hasattr(conn, "ensure_connection"):
        connection: Any = conn
        connection.ensure_connection()
        found = _driver_writer(connection.connection, "Django")
        if found is not None and connection.get_autocommit() and not connection.in_atomic_block:
            raise outside_transaction("Django", "write inside `with transaction.atomic():`")
    if found is None:
        if isinstance(conn, (psycopg.AsyncConnection, psycopg.AsyncCursor)) or module in ("asyncpg",):
            raise UnsupportedConnection(
                f"conn: {type(conn).__name__} is asynchronous: use `await enqueue_async(...)`"
            )
        raise UnsupportedConnection(f"conn: expected {SYNC_STACKS}; got {type(conn).__name__}")
    return found


async def _sqlalchemy_async_driver(obj: Any) -> Any | None:
    from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession

    if isinstance(obj, AsyncSession):
        obj = await obj.connection()
    if not isinstance(obj, AsyncConnection):
        return None
    if not obj.in_transaction():
        await obj.begin()
    driver: Any = (await obj.get_raw_connection()).driver_connection
    if _module(driver) == "asyncpg" and not driver.is_in_transaction():
        # SQLAlchemy's asyncpg adapter opens the transaction with its first statement: make
        # it (one round trip, only when the app has not written anything yet in it).
        await obj.exec_driver_sql(raw("first_statement"))
    return driver


async def async_writer_for(conn: object) -> AsyncWriter:
    """The async writer for what the caller passed, or UnsupportedConnection listing what works."""
    if isinstance(conn, psycopg.AsyncConnection):
        return AsyncPsycopgWriter(conn)
    if isinstance(conn, psycopg.AsyncCursor):
        return AsyncPsycopgWriter(conn.connection)
    module = _module(conn)
    if module == "asyncpg" and hasattr(conn, "is_in_transaction"):
        return AsyncpgWriter(conn)
    if module == "sqlalchemy":
        raw = await _sqlalchemy_async_driver(conn)
        if isinstance(raw, psycopg.AsyncConnection):
            return AsyncPsycopgWriter(raw, "SQLAlchemy (psycopg)")
        if raw is not None and _module(raw) == "asyncpg":
            return AsyncpgWriter(raw, "SQLAlchemy (asyncpg)")
    if isinstance(conn, (psycopg.Connection, psycopg.Cursor)) or module in ("psycopg2", "django"):
        raise UnsupportedConnection(f"conn: {type(conn).__name__} is synchronous: use `enqueue(...)`")
    raise UnsupportedConnection(f"conn: expected {ASYNC_STACKS}; got {type(conn).__name__}")
