"""A pytest plugin for applications' own tests: assert what the code under test enqueued,
with no relay and no broker.

Installed with outbox (entry point ``pytest11``), so the fixture is there in any test
suite that has outbox installed:

    def test_checkout_enqueues_order_created(client, outbox_events):
        client.post("/orders", json={"sku": "a-1"})
        event = outbox_events.assert_enqueued(topic="orders.created", key="order-1")
        assert event.payload["sku"] == "a-1"

It works for every stack ``enqueue`` takes (psycopg 3, psycopg2, SQLAlchemy, Django,
asyncpg): it records each event as ``enqueue``/``enqueue_many`` (or their async twins)
write it, after validation, with the values the relay would deliver. It records what
was written in the transaction; a transaction the test then rolls back does not take
it off the list.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, overload

import pytest

from outbox.events import EncodedEvent
from outbox.write import writer

_UNSET: Any = object()


@dataclass(frozen=True)
class Enqueued:
    """One event as the code under test enqueued it."""

    event_id: uuid.UUID
    topic: str
    key: str | bytes | None  # text when the key is UTF-8, else bytes
    headers: dict[str, str | bytes]  # the event's headers (content-type, trace context …)
    payload: Any  # decoded when the event is JSON, else the bytes
    raw: bytes = field(repr=False)  # the payload bytes as the relay sends them
    schema: str = "outbox"
    delay: float = 0.0

    @classmethod
    def _of(cls, schema: str, ev: EncodedEvent) -> Enqueued:
        headers: dict[str, str | bytes] = {}
        for name, value in ev.headers.items():
            if isinstance(value, str):
                headers[name] = value
            else:  # {"base64": …}: a header value that is not UTF-8
                headers[name] = base64.b64decode(value["base64"])
        payload: Any = ev.payload
        if str(headers.get("content-type", "")).startswith("application/json"):
            payload = json.loads(ev.payload)
        key: str | bytes | None = ev.key
        if ev.key is not None:
            try:
                key = ev.key.decode("utf-8")
            except UnicodeDecodeError:
                key = ev.key
        return cls(ev.event_id, ev.topic, key, headers, payload, ev.payload, schema, ev.delay)

    def _line(self) -> str:
        return f"{self.topic} key={self.key!r} payload={self.payload!r}"


class EnqueuedEvents(Sequence[Enqueued]):
    """The events enqueued since the fixture started, in order."""

    def __init__(self) -> None:
        self._events: list[Enqueued] = []

    def _record(self, schema: str, events: Sequence[EncodedEvent]) -> None:
        self._events.extend(Enqueued._of(schema, ev) for ev in events)

    @overload
    def __getitem__(self, index: int) -> Enqueued: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[Enqueued]: ...
    def __getitem__(self, index: int | slice) -> Enqueued | Sequence[Enqueued]:
        return self._events[index]

    def __len__(self) -> int:
        return len(self._events)

    def clear(self) -> None:
        """Forget what was recorded so far (after a test's set-up, say)."""
        self._events.clear()

    def matching(
        self,
        topic: str | None = None,
        *,
        key: Any = _UNSET,
        payload: Any = _UNSET,
        headers: dict[str, str | bytes] | None = None,
    ) -> list[Enqueued]:
        """The events with this topic, key and payload (equal), and these headers among theirs."""
        return [
            e
            for e in self._events
            if (topic is None or e.topic == topic)
            and (key is _UNSET or e.key == key)
            and (payload is _UNSET or e.payload == payload)
            and all(e.headers.get(k) == v for k, v in (headers or {}).items())
        ]

    def assert_enqueued(
        self,
        topic: str | None = None,
        *,
        key: Any = _UNSET,
        payload: Any = _UNSET,
        headers: dict[str, str | bytes] | None = None,
        count: int | None = None,
    ) -> Enqueued:
        """The one event that matches (or the last of ``count``); AssertionError listing what
        was enqueued when none does, or when ``count`` is given and differs."""
        found = self.matching(topic, key=key, payload=payload, headers=headers)
        wanted = _describe(topic, key, payload, headers)
        if not found or (count is not None and len(found) != count):
            seen = "\n".join(f"  {e._line()}" for e in self._events) or "  (nothing)"
            many = f"{count} events" if count is not None else "an event"
            raise AssertionError(f"expected {many}{wanted}, found {len(found)}; enqueued:\n{seen}")
        return found[-1]

    def assert_nothing_enqueued(self, topic: str | None = None) -> None:
        """AssertionError listing them when any event (of ``topic``, if given) was enqueued."""
        found = self.matching(topic)
        if found:
            seen = "\n".join(f"  {e._line()}" for e in found)
            raise AssertionError(f"expected no events{_describe(topic)}, found {len(found)}:\n{seen}")


def _describe(
    topic: str | None, key: Any = _UNSET, payload: Any = _UNSET, headers: dict[str, Any] | None = None
) -> str:
    parts = [f"topic={topic!r}"] if topic is not None else []
    parts += [f"key={key!r}"] if key is not _UNSET else []
    parts += [f"payload={payload!r}"] if payload is not _UNSET else []
    parts += [f"headers⊇{headers!r}"] if headers else []
    return (" with " + ", ".join(parts)) if parts else ""


_active: list[EnqueuedEvents] = []


@pytest.fixture
def outbox_events() -> Iterator[EnqueuedEvents]:
    """The events the test's code enqueues, on any stack (see :class:`EnqueuedEvents`)."""
    events = EnqueuedEvents()
    writer.recorders.append(events._record)
    _active.append(events)
    try:
        yield events
    finally:
        writer.recorders.remove(events._record)
        _active.remove(events)


def assert_enqueued(
    topic: str | None = None,
    *,
    key: Any = _UNSET,
    payload: Any = _UNSET,
    headers: dict[str, str | bytes] | None = None,
    count: int | None = None,
) -> Enqueued:
    """:meth:`EnqueuedEvents.assert_enqueued` on the test's ``outbox_events`` fixture."""
    if not _active:
        raise RuntimeError("assert_enqueued: the test must use the outbox_events fixture")
    return _active[-1].assert_enqueued(topic, key=key, payload=payload, headers=headers, count=count)


__all__ = ["Enqueued", "EnqueuedEvents", "assert_enqueued", "outbox_events"]
