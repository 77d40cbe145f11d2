"""The write side: put events into the outbox inside the caller's transaction.

``enqueue``/``enqueue_many`` never commit or roll back: the event becomes visible
to the relay exactly when the caller's transaction commits (atomic enqueue).
Every stack (psycopg 3, psycopg2, SQLAlchemy, Django, asyncpg) shares the
validation and encoding here; :mod:`outbox.write.stacks` knows how to write on each.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import Any

from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox.errors import InvalidEventType
from outbox.events import EncodedEvent, encode_event, encode_event_mapping
from outbox.store.schema import schema_or_default
from outbox.write.stacks import async_writer_for, writer_for

_PROPAGATOR = TraceContextTextMapPropagator()


def current_trace_headers() -> dict[str, str]:
    """W3C ``traceparent``/``tracestate`` of the active span, or {} when none is active."""
    if not trace.get_current_span().get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    return carrier


def _encode_many(events: Iterable[Mapping[str, Any]]) -> list[EncodedEvent]:
    if isinstance(events, (str, bytes, Mapping)):
        raise InvalidEventType("events: expected an iterable of mappings, not a single value")
    trace_headers = current_trace_headers()
    return [encode_event_mapping(i, ev, trace_headers) for i, ev in enumerate(events)]


def _encode_one(
    topic: str,
    payload: Any,
    key: str | bytes | None,
    headers: Mapping[str, str | bytes] | None,
    delay: float | timedelta | None,
    type: str | None,
    subject: str | None,
    expires_at: datetime | None,
) -> EncodedEvent:
    return encode_event(
        topic,
        payload,
        key=key,
        headers=headers,
        delay=delay,
        trace_headers=current_trace_headers(),
        type=type,
        subject=subject,
        expires_at=expires_at,
    )


def _split(events: list[EncodedEvent], wal: bool) -> tuple[list[EncodedEvent], list[EncodedEvent]]:
    """(emitted to the WAL, inserted into the events table): in WAL capture every event but the
    delayed ones, which wait in the table for their time; in table capture none."""
    if not wal:
        return [], events
    return [ev for ev in events if not ev.delay], [ev for ev in events if ev.delay]


# -- sync ---------------------------------------------------------------------


def enqueue(
    conn: Any,
    topic: str,
    payload: Any,
    *,
    key: str | bytes | None = None,
    headers: Mapping[str, str | bytes] | None = None,
    delay: float | timedelta | None = None,
    type: str | None = None,
    subject: str | None = None,
    expires_at: datetime | None = None,
    schema: str | None = None,
) -> uuid.UUID:
    """Add one event to the outbox in ``conn``'s current transaction; return its event id.

    ``conn``: a psycopg ``Connection``/``Cursor``, a psycopg2 connection/cursor, an
    SQLAlchemy ``Session``/``Connection`` or a Django connection (:mod:`outbox.write.stacks`).
    It must be in a transaction: on a connection in autocommit mode, outside any
    transaction, ``enqueue`` refuses (:class:`~outbox.errors.OutsideTransaction`).

    ``payload``: bytes (sent as is), str (UTF-8) or any JSON-serialisable value
    (compact JSON, header ``content-type: application/json``). ``delay``: seconds
    or a ``timedelta`` before which the event is not delivered. ``type`` / ``subject``:
    the CloudEvents ``type`` (default: the topic) and ``subject`` the relay sends with
    ``--cloudevents``; stored with the event. ``expires_at``: a timezone-aware ``datetime``;
    claimed at or after it, the event is not sent but dead-lettered with the kind ``expired``,
    which never holds back its key's later events.
    """
    ev = _encode_one(topic, payload, key, headers, delay, type, subject, expires_at)
    name = schema_or_default(schema)
    writer = writer_for(conn)
    writer.require_transaction()
    if writer.ensure_schema(name) and not ev.delay:
        writer.emit(name, [ev])  # WAL capture: a logical decoding message, no row
    else:
        writer.insert(name, ev)
    _recorded(name, [ev])
    return ev.event_id


def enqueue_many(
    conn: Any, events: Iterable[Mapping[str, Any]], *, schema: str | None = None
) -> list[uuid.UUID]:
    """Add many events (mappings with ``enqueue``'s keyword names) in one go.

    All events are validated before any is written. Then each stack's fast path:
    binary COPY on psycopg 3 (a pipelined batch when some have a delay), one
    multi-row ``INSERT`` on psycopg2 (and Django or SQLAlchemy over it).
    """
    encoded = _encode_many(events)
    name = schema_or_default(schema)
    writer = writer_for(conn)
    writer.require_transaction()
    wal = writer.ensure_schema(name)
    if encoded:
        now, later = _split(encoded, wal)
        if now:
            writer.emit(name, now)
        if later:
            writer.insert_many(name, later)
        _recorded(name, encoded)
    return [ev.event_id for ev in encoded]


# -- async --------------------------------------------------------------------


async def enqueue_async(
    conn: Any,
    topic: str,
    payload: Any,
    *,
    key: str | bytes | None = None,
    headers: Mapping[str, str | bytes] | None = None,
    delay: float | timedelta | None = None,
    type: str | None = None,
    subject: str | None = None,
    expires_at: datetime | None = None,
    schema: str | None = None,
) -> uuid.UUID:
    """``enqueue`` for a psycopg ``AsyncConnection``/``AsyncCursor``, an asyncpg
    ``Connection`` (also from a pool) or an SQLAlchemy ``AsyncSession``/``AsyncConnection``."""
    ev = _encode_one(topic, payload, key, headers, delay, type, subject, expires_at)
    name = schema_or_default(schema)
    writer = await async_writer_for(conn)
    writer.require_transaction()
    if await writer.ensure_schema(name) and not ev.delay:
        await writer.emit(name, [ev])
    else:
        await writer.insert(name, ev)
    _recorded(name, [ev])
    return ev.event_id


async def enqueue_many_async(
    conn: Any, events: Iterable[Mapping[str, Any]], *, schema: str | None = None
) -> list[uuid.UUID]:
    """``enqueue_many`` for the async stacks (asyncpg: ``copy_records_to_table``)."""
    encoded = _encode_many(events)
    name = schema_or_default(schema)
    writer = await async_writer_for(conn)
    writer.require_transaction()
    wal = await writer.ensure_schema(name)
    if encoded:
        now, later = _split(encoded, wal)
        if now:
            await writer.emit(name, now)
        if later:
            await writer.insert_many(name, later)
        _recorded(name, encoded)
    return [ev.event_id for ev in encoded]


# -- what tests observe (outbox.testing) ----------------------------------------

Recorder = Callable[[str, Sequence[EncodedEvent]], None]
recorders: list[Recorder] = []  # called with every batch written (the pytest plugin adds one)


def _recorded(schema: str, events: Sequence[EncodedEvent]) -> None:
    for record in recorders:
        record(schema, events)
