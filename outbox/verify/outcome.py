"""One delivered event read back: what the archive says went where, what the sink holds there,
and the verdict (present, missing, expired, unverifiable)."""

from __future__ import annotations

import hashlib
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from outbox.errors import OutboxError

PRESENT = "present"  # the same event is at its coordinates
MISSING = "missing"  # nothing there, or another event, and not by the sink's own retention
EXPIRED = "expired"  # below where the sink's retained log starts now (retention, trimming)
UNVERIFIABLE = "unverifiable"  # the sink keeps no log to read back (queues, webhooks, Pub/Sub)
OUTCOMES = (PRESENT, MISSING, EXPIRED, UNVERIFIABLE)


@dataclass(frozen=True)
class Archived:
    """An archived delivery: the event as written, and its coordinates in the sink."""

    id: int  # the archive row's (the event's) id
    event_id: str
    topic: str
    key: bytes | None
    payload: bytes
    partition: int | None  # Kafka's partition
    offset: int | None  # Kafka's offset, JetStream's sequence
    ref: str | None  # a Redis Streams entry id, a JetStream stream

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> Archived:
        rid, event_id, topic, key, payload, partition, offset, ref = row[:8]
        return cls(
            int(rid), str(event_id), str(topic), None if key is None else bytes(key), bytes(payload),
            None if partition is None else int(partition), None if offset is None else int(offset),
            None if ref is None else str(ref),
        )  # fmt: skip


@dataclass(frozen=True)
class Held:
    """What a sink holds at an event's coordinates: its event id, and its key and payload where
    the sink returns them (None: not returned, not compared)."""

    event_id: str | None
    key: bytes | None = None
    payload: bytes | None = None
    key_returned: bool = False


@dataclass(frozen=True)
class Verdict:
    outcome: str
    reason: str | None = None


def digest(data: bytes | None) -> str | None:
    return None if data is None else hashlib.sha256(data).hexdigest()


def judge(event: Archived, held: Held | None, *, compare_bodies: bool = True) -> Verdict:
    """``event`` against what its sink holds at its coordinates (None: nothing)."""
    if held is None:
        return Verdict(MISSING, "nothing at its coordinates")
    if held.event_id != event.event_id:
        other = (held.event_id or "without an event-id")[:64]  # the sink's text: bounded, escaped when shown
        return Verdict(MISSING, f"another event ({other}) at its coordinates")
    if compare_bodies and held.payload is not None and digest(held.payload) != digest(event.payload):
        return Verdict(MISSING, "the record there has another payload")
    if compare_bodies and held.key_returned and digest(held.key) != digest(event.key):
        return Verdict(MISSING, "the record there has another key")
    return Verdict(PRESENT)


K = TypeVar("K")


def by_place(
    events: list[Archived], place: Callable[[Archived], K | None], lacking: str
) -> tuple[dict[int, Verdict], dict[K, list[Archived]]]:
    """``events`` grouped by where their sink keeps them (``place``: a partition, a stream);
    those whose coordinates the archive lacks (``place`` None) already judged missing, saying
    ``lacking``. Verdicts are keyed by ``id(event)``."""
    verdicts: dict[int, Verdict] = {}
    groups: dict[K, list[Archived]] = defaultdict(list)
    for event in events:
        at = place(event)
        if at is None:
            verdicts[id(event)] = Verdict(MISSING, f"the archive holds no {lacking}")
        else:
            groups[at].append(event)
    return verdicts, groups


class SinkUnreadable(OutboxError):
    """A sink could not be read back (unreachable, refused): no verdict on its events."""

    exit_code = 2


class Reader:
    """Reads a sink's records back at archived coordinates. ``check`` answers a verdict for each
    event, in order; ``close`` lets its connections go."""

    def check(self, events: list[Archived]) -> list[Verdict]:
        raise NotImplementedError

    def close(self) -> None:
        pass
