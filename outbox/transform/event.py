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


@dataclass(frozen=True)
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

    def __getattr__(self, name: str) -> Any:
        """``headers`` and ``created_at`` of an event the relay made (to_event), on first read."""
        made = self.__dict__
        if name == "headers" and "_headers" in made:
            shown = dict(made["_headers"])
            shown.pop(EVENT_ID_HEADER, None)  # the relay's own (decode_row's last)
            value: Any = MappingProxyType(shown)
            made["headers"] = value
        elif name == "created_at" and "_created" in made:
            value = datetime.fromtimestamp(made["_created"], timezone.utc)
            made["created_at"] = value
        else:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return value


def to_event(claimed: ClaimedEvent) -> Event:
    """What the function is called with."""
    _, event_id, topic, key, payload, headers, created, _, type_, subject, _, _ = claimed
    # The fields set at once, past the frozen dataclass's __init__ (which sets them one by one
    # through object.__setattr__), and ``headers`` and ``created_at`` made when first read
    # (Event.__getattr__): a transform that reads neither does not pay for them (decision 0013).
    event = _new(Event)
    _set(
        event,
        "__dict__",
        {
            "event_id": event_id,
            "topic": topic,
            "key": key,
            "payload": payload,
            "type": type_,
            "subject": subject,
            "_headers": headers,
            "_created": created,
        },
    )
    return event


_new = object.__new__
_set = object.__setattr__


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
    if after.key != before.key:
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
