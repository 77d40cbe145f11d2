"""The write side: put events into the outbox inside the caller's transaction.

``enqueue``/``enqueue_many`` never commit or roll back: the event becomes visible
to the relay exactly when the caller's transaction commits (atomic enqueue).
The sync and async twins share all logic (validation, encoding, SQL); only the
``execute`` call differs.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any

import psycopg
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from psycopg.types.json import Jsonb

from outbox.errors import InvalidEventType, NotMigrated, UnsupportedConnection
from outbox.events import EncodedEvent, encode_event, encode_event_mapping
from outbox.queries import query
from outbox.schema import DEFAULT_SCHEMA, validate_schema

_PROPAGATOR = TraceContextTextMapPropagator()

# Schemas already known to hold an outbox, per connection. Checking costs a round
# trip, so it happens once per connection and schema; the check keeps an unknown
# schema from aborting the caller's transaction with UndefinedTable.
_known: weakref.WeakKeyDictionary[Any, set[str]] = weakref.WeakKeyDictionary()

AnyConn = psycopg.Connection[Any] | psycopg.Cursor[Any]
AnyAsyncConn = psycopg.AsyncConnection[Any] | psycopg.AsyncCursor[Any]


def current_trace_headers() -> dict[str, str]:
    """W3C ``traceparent``/``tracestate`` of the active span, or {} when none is active."""
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def _schema(schema: str | None) -> str:
    return DEFAULT_SCHEMA if schema is None else validate_schema(schema)


def _params(ev: EncodedEvent) -> tuple[Any, ...]:
    return (ev.event_id, ev.topic, ev.key, ev.payload, Jsonb(ev.headers), ev.delay)


def _unknown_schema(schema: str) -> NotMigrated:
    return NotMigrated(f"schema: {schema!r} holds no outbox tables; run `outbox migrate --schema {schema}`")


def _connection(conn: Any) -> Any:
    return conn.connection if isinstance(conn, (psycopg.Cursor, psycopg.AsyncCursor)) else conn


def _check_conn_type(conn: object, *, async_: bool) -> None:
    if async_:
        ok = isinstance(conn, (psycopg.AsyncConnection, psycopg.AsyncCursor))
        want = "a psycopg AsyncConnection or AsyncCursor"
    else:
        ok = isinstance(conn, (psycopg.Connection, psycopg.Cursor))
        want = "a psycopg Connection or Cursor (use enqueue_async for async)"
    if not ok:
        raise UnsupportedConnection(f"conn: expected {want}, got {type(conn).__name__}")


def _encode_many(events: Iterable[Mapping[str, Any]]) -> list[EncodedEvent]:
    if isinstance(events, (str, bytes, Mapping)):
        raise InvalidEventType("events: expected an iterable of mappings, not a single value")
    trace_headers = current_trace_headers()
    return [encode_event_mapping(i, ev, trace_headers) for i, ev in enumerate(events)]


# -- sync ---------------------------------------------------------------------


def _ensure_schema(conn: AnyConn, schema: str) -> None:
    base = _connection(conn)
    seen = _known.setdefault(base, set())
    if schema in seen:
        return
    row = conn.execute(query("events_table", schema), (schema,)).fetchone()
    if not row or not row[0]:
        raise _unknown_schema(schema)
    seen.add(schema)


def enqueue(
    conn: AnyConn,
    topic: str,
    payload: Any,
    *,
    key: str | bytes | None = None,
    headers: Mapping[str, str | bytes] | None = None,
    delay: float | timedelta | None = None,
    schema: str | None = None,
) -> uuid.UUID:
    """Add one event to the outbox in ``conn``'s current transaction; return its event id.

    ``payload``: bytes (sent as is), str (UTF-8) or any JSON-serialisable value
    (compact JSON, header ``content-type: application/json``). ``delay``: seconds
    or a ``timedelta`` before which the event is not delivered.
    """
    _check_conn_type(conn, async_=False)
    ev = encode_event(
        topic,
        payload,
        key=key,
        headers=headers,
        delay=delay,
        trace_headers=current_trace_headers(),
    )
    name = _schema(schema)
    _ensure_schema(conn, name)
    conn.execute(query("insert_event", name), _params(ev))
    return ev.event_id


def enqueue_many(
    conn: AnyConn, events: Iterable[Mapping[str, Any]], *, schema: str | None = None
) -> list[uuid.UUID]:
    """Add many events (mappings with ``enqueue``'s keyword names) in one go.

    All events are validated before any is written. Without delays they are
    streamed with binary COPY; with delays, sent as one pipelined batch.
    """
    _check_conn_type(conn, async_=False)
    encoded = _encode_many(events)
    name = _schema(schema)
    _ensure_schema(conn, name)
    if not encoded:
        return []
    base = _connection(conn)
    with base.cursor() as cur:
        if any(ev.delay for ev in encoded):
            cur.executemany(query("insert_event", name), [_params(ev) for ev in encoded])
        else:
            with cur.copy(query("copy_events", name)) as copy:
                copy.set_types(["uuid", "text", "bytea", "bytea", "jsonb"])
                for ev in encoded:
                    copy.write_row((ev.event_id, ev.topic, ev.key, ev.payload, Jsonb(ev.headers)))
    return [ev.event_id for ev in encoded]


# -- async --------------------------------------------------------------------


async def _ensure_schema_async(conn: AnyAsyncConn, schema: str) -> None:
    base = _connection(conn)
    seen = _known.setdefault(base, set())
    if schema in seen:
        return
    cur = await conn.execute(query("events_table", schema), (schema,))
    row = await cur.fetchone()
    if not row or not row[0]:
        raise _unknown_schema(schema)
    seen.add(schema)


async def enqueue_async(
    conn: AnyAsyncConn,
    topic: str,
    payload: Any,
    *,
    key: str | bytes | None = None,
    headers: Mapping[str, str | bytes] | None = None,
    delay: float | timedelta | None = None,
    schema: str | None = None,
) -> uuid.UUID:
    """``enqueue`` for a psycopg ``AsyncConnection`` (or ``AsyncCursor``)."""
    _check_conn_type(conn, async_=True)
    ev = encode_event(
        topic,
        payload,
        key=key,
        headers=headers,
        delay=delay,
        trace_headers=current_trace_headers(),
    )
    name = _schema(schema)
    await _ensure_schema_async(conn, name)
    await conn.execute(query("insert_event", name), _params(ev))
    return ev.event_id


async def enqueue_many_async(
    conn: AnyAsyncConn, events: Iterable[Mapping[str, Any]], *, schema: str | None = None
) -> list[uuid.UUID]:
    """``enqueue_many`` for a psycopg ``AsyncConnection`` (or ``AsyncCursor``)."""
    _check_conn_type(conn, async_=True)
    encoded = _encode_many(events)
    name = _schema(schema)
    await _ensure_schema_async(conn, name)
    if not encoded:
        return []
    base = _connection(conn)
    async with base.cursor() as cur:
        if any(ev.delay for ev in encoded):
            await cur.executemany(query("insert_event", name), [_params(ev) for ev in encoded])
        else:
            async with cur.copy(query("copy_events", name)) as copy:
                copy.set_types(["uuid", "text", "bytea", "bytea", "jsonb"])
                for ev in encoded:
                    await copy.write_row((ev.event_id, ev.topic, ev.key, ev.payload, Jsonb(ev.headers)))
    return [ev.event_id for ev in encoded]
