"""The event a transform sees and returns (``outbox.Event``), and its way back to what the sinks
take: every field the function set is checked as ``enqueue`` checks it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from types import MappingProxyType
from typing import Any

from outbox.errors import InvalidEvent, InvalidEventType
from outbox.events import (
    EVENT_ID_HEADER,
    MAX_SUBJECT_CHARS,
    MAX_TYPE_CHARS,
    ClaimedEvent,
    MessageHeaders,
    encode_attribute,
    encode_headers,
    encode_key,
    encode_payload,
    encode_topic,
)


@dataclass(frozen=True, slots=True)
class Event:
    """An event as a transform (``outbox relay --transform``) sees it.

    Return it changed with ``dataclasses.replace(event, ...)``: a new ``topic`` routes it anew,
    a new ``key`` is the key the sink gets. ``event_id`` and ``created_at`` cannot change.
    ``headers`` are the writer's (without ``event-id``, which every sink adds); return new ones
    as any mapping of names to ``str`` or ``bytes``. ``payload`` may come back as ``bytes``,
    ``str`` or anything JSON can encode.
    """

    event_id: str
    topic: str
    key: bytes | None
    payload: bytes
    headers: Mapping[str, str | bytes | None]
    type: str | None
    subject: str | None
    created_at: datetime


def to_event(claimed: ClaimedEvent) -> Event:
    """What the function is called with."""
    headers = claimed.headers
    if headers and headers[-1][0] == EVENT_ID_HEADER:  # decode_row's last: the relay's own
        headers = headers[:-1]
    return Event(
        claimed.event_id,
        claimed.topic,
        claimed.key,
        claimed.payload,
        MappingProxyType(dict(headers)),
        claimed.type,
        claimed.subject,
        datetime.fromtimestamp(claimed.created_at, timezone.utc),
    )


def from_event(claimed: ClaimedEvent, before: Event, after: object) -> ClaimedEvent:
    """``after``, what the function returned for ``before`` (made from ``claimed``), as the sinks
    take it. Raises InvalidEvent naming the field the function got wrong."""
    if not isinstance(after, Event):
        raise InvalidEventType(f"returned {type(after).__name__}: expected an outbox.Event or None")
    if after.event_id != before.event_id:
        raise InvalidEvent("event_id: a transform cannot change it (consumers deduplicate on it)")
    if after.created_at != before.created_at:
        raise InvalidEvent("created_at: a transform cannot change it")
    changes: dict[str, Any] = {}
    if after.topic != before.topic:
        changes["topic"] = encode_topic(after.topic)
    if after.key is not before.key and after.key != before.key:
        changes["key"] = encode_key(after.key)
    if after.payload is not before.payload:
        changes["payload"] = encode_payload(after.payload)[0]
    if after.headers is not before.headers:
        changes["headers"] = _headers(after.headers, before.event_id)
    if after.type != before.type:
        changes["type"] = encode_attribute(after.type, "type", MAX_TYPE_CHARS)
    if after.subject != before.subject:
        changes["subject"] = encode_attribute(after.subject, "subject", MAX_SUBJECT_CHARS)
    return claimed._replace(**changes) if changes else claimed


def _headers(headers: object, event_id: str) -> MessageHeaders:
    """A transform's headers as the sinks take them, checked as enqueue checks a writer's (no
    reserved name, names HTTP tokens), with ``event-id`` last as the relay adds it."""
    if not isinstance(headers, Mapping):
        raise InvalidEventType(f"headers: expected a mapping, got {type(headers).__name__}")
    checked = encode_headers({n: b"" if v is None else v for n, v in headers.items()})
    out: MessageHeaders = [(name, _bytes(headers[name])) for name in checked]
    out.append((EVENT_ID_HEADER, event_id.encode()))
    return out


def _bytes(value: str | bytes | None) -> bytes:
    if value is None:
        return b""
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)
