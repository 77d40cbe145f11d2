"""The sink interface: hand over one event, learn its outcome now or later.

A sink answers each event with exactly one :data:`Outcome`:

- :class:`Delivered` — the sink acknowledged it durably (Kafka: the delivery
  report of an ``acks=all`` produce); the relay archives it.
- :class:`Retry` — it may succeed later; the relay persists the attempt and
  schedules the next one with backoff.
- :class:`Dead` — it can never succeed (too large, invalid destination, not
  authorised); the relay dead-letters it at once with the reason.
- :data:`HELD` — not sent, because an earlier event of its key failed first
  (only a sink wrapped in :class:`~outbox.sinks.chains.KeyChains` answers it);
  the relay leaves it pending, untouched, like an event it held back itself.

A failure carries a ``kind`` and a ``reason``. The kind is short, stable and
of low cardinality (``MSG_SIZE_TOO_LARGE``, ``no_route``, ``http_503``): it is
set once, where the sink classifies the failure, and is what metrics and
spans report as ``error.type``. The reason is the full text kept on the row.

``produce`` returns an outcome immediately when it already knows it (for
example a message the client rejects synchronously) and otherwise ``None``,
calling ``report`` from inside a later ``poll``/``flush``. The relay owns
ordering: it never calls ``produce`` for an event whose key is held back.

A sink may also have ``produce_many(events, outcomes, settle) -> int``: queue a
batch in order, as ``produce`` would each event, and stop before the first one
it cannot take as it is, returning how many it queued; the relay calls it when
no key of the batch is held and goes on with ``produce`` from where it stopped
(:meth:`~outbox.sinks.kafka.KafkaSink.produce_many`). Event ``i``'s outcome is
stored into ``outcomes[i]`` when it is a :class:`Delivered`, and otherwise given
to ``settle(i, outcome)`` (which also holds the key). A wrapper that overrides
``produce`` does not inherit it, so the relay never bypasses the wrapper.

And ``send_now()``: send what is queued at once rather than wait to batch it
with more (Kafka's ``linger.ms``). The relay calls it after a batch that was
not full, when there is no backlog to batch with and waiting only adds latency;
after a full batch it lets the client batch. Wrappers and the router pass it on.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeGuard, cast, runtime_checkable

from outbox.events import ClaimedEvent


class Delivered(NamedTuple):
    """Acknowledged by the sink, with the sink's coordinates where it has them.

    ``partition``/``offset``: Kafka's; ``offset`` is the stream sequence for NATS.
    ``ref``: the sink's own name for what it stored (a Redis entry id, a NATS
    stream). All three are archived. A NamedTuple: one is built per delivered
    event on the relay's hot path.
    """

    partition: int | None = None
    offset: int | None = None
    ref: str | None = None


@dataclass(frozen=True, slots=True)
class Retry:
    """Not delivered this time; it may succeed later (not before ``delay`` seconds, if given:
    an HTTP ``Retry-After``)."""

    kind: str
    reason: str
    delay: float | None = None


@dataclass(frozen=True, slots=True)
class Dead:
    """Never deliverable as it is."""

    kind: str
    reason: str


class Held:
    """Not sent: an earlier event of the same key failed while this one waited behind it."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "HELD"


HELD = Held()

Outcome = Delivered | Retry | Dead | Held
Failure = Retry | Dead
Report = Callable[[Outcome], None]
Settle = Callable[[int, Outcome], None]  # the outcome of a batch's event i (produce_many)


class OutcomeSlots(Protocol):
    """A batch's outcome per event (produce_many stores deliveries straight into it)."""

    def __setitem__(self, index: int, outcome: Outcome, /) -> None: ...


# Kinds the relay itself assigns (sinks add their own).
CORRUPT_EVENT = "corrupt_event"
SINK_REPLACED = "sink_replaced"  # in flight when the relay replaced an unhealthy sink, unreported
EXPIRED = "expired"  # claimed at or after its expires_at: not sent, and its key never parked

# Retry kinds that mean "the sink could not be reached", not "it refused this event": when the
# sink answers again, events that last failed so are retried at once (LaneUpkeep.sinks_back).
UNREACHABLE_KINDS = frozenset(
    {
        "unavailable",  # an asyncio sink's connection is down (sinks/aio.py)
        "timeout",  # no confirmation in time (asyncio sinks, webhooks)
        "_MSG_TIMED_OUT",  # Kafka: not acknowledged within the delivery timeout
        "_TIMED_OUT",
        "_TRANSPORT",
        "_ALL_BROKERS_DOWN",
        "_RESOLVE",
        "NETWORK_EXCEPTION",
        "REQUEST_TIMED_OUT",
        "claim_check_store",  # the claim-check store was unreachable
        "producer_failed",  # Kafka: the producer was fenced or failed, and is being replaced
        SINK_REPLACED,
    }
)


class Sink(Protocol):
    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        """Start sending ``event``; return its outcome if known now, else call ``report`` later."""

    def poll(self, timeout: float) -> int | None:
        """Serve pending reports, waiting at most ``timeout`` seconds for the first one.

        Returns how many it served (``None`` counts as unknown)."""

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for every report; return how many are still pending."""

    def healthy(self) -> bool:
        """False once the sink has hit a fatal error and must be recreated."""

    def close(self, timeout: float) -> None:
        """Flush within ``timeout`` and release resources; pending reports are dropped."""


# Optional features: a sink that has one declares it by having its members. They are found here,
# through these protocols, and nowhere by probing attribute names.


@runtime_checkable
class ProducesMany(Protocol):
    """Takes a batch in one call (KafkaSink): see ``produce_many`` above."""

    def produce_many(self, events: Sequence[ClaimedEvent], outcomes: OutcomeSlots, settle: Settle) -> int: ...


@runtime_checkable
class SendsNow(Protocol):
    """Batches sends on the wire (Kafka's linger), and can send what is queued at once."""

    def send_now(self) -> None: ...


@runtime_checkable
class Reachable(Protocol):
    """Knows whether its broker can be reached now (``trouble``: why not, or None), and can look
    again (``probe``): the relay's readiness and its retry-at-once after an outage use it."""

    def trouble(self) -> str | None: ...

    def probe(self) -> None: ...


@runtime_checkable
class KeyOrder(Protocol):
    """Says whether it keeps the order of a key's events in flight (Kafka's partitions do; a
    sink that does not say so is taken to). One that does not gets the relay's key chains."""

    keeps_key_order: bool


@runtime_checkable
class Named(Protocol):
    """Its name for labels and logs, never with credentials (``kafka://host:port``)."""

    name: str


@runtime_checkable
class Shaped(Protocol):
    """Names its spans and their attributes itself (OpenTelemetry's messaging conventions)."""

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]: ...


@runtime_checkable
class Signals(Protocol):
    """Sets ``wake`` when reports are ready (Kafka's and the asyncio sinks): a router shares one
    among them, and the relay waits on it with the rest of its news."""

    wake: threading.Event


DIGEST_PREFIX = "sha256-"  # a key's digest, where a sink cannot take the key as a name


def key_digest(key: bytes) -> str:
    """``key`` as a name where a sink cannot take it itself (a Pub/Sub ordering key, an SQS FIFO
    group id): ``sha256-<hex>``. A sink that uses a text key as itself digests every key that starts
    with :data:`DIGEST_PREFIX` too: otherwise one writer's text key ``sha256-<hex>`` named another's
    binary key's group, and a failure of one held back the other's events."""
    return DIGEST_PREFIX + hashlib.sha256(key).hexdigest()


# A sink's methods are its class's: the batch path asks its class once, not the instance each
# time (an isinstance of a runtime Protocol walks its members at every call: decision 0013).
_KINDS: dict[tuple[type, type], bool] = {}  # (a sink's class, a protocol): does it have it?


def _is(cls: type, protocol: type) -> bool:
    known = _KINDS.get((cls, protocol))
    if known is None:
        known = _KINDS[cls, protocol] = issubclass(cls, protocol)
    return known


def many_of(sink: object) -> ProducesMany | None:
    """``sink`` if it takes a batch in one call (ProducesMany), else None."""
    return cast("ProducesMany", sink) if _is(type(sink), ProducesMany) else None


def _sends_now(sink: Sink) -> TypeGuard[SendsNow]:
    return _is(type(sink), SendsNow)


def send_now(sink: Sink) -> None:
    """``sink.send_now()`` when the sink has it (SendsNow); else nothing."""
    if _sends_now(sink):
        sink.send_now()


def keeps_key_order(sink: object) -> bool:
    return not isinstance(sink, KeyOrder) or bool(sink.keeps_key_order)


def wake_of(sink: Sink) -> threading.Event | None:
    """The event ``sink`` sets whenever reports are ready, or None: a sink that must be polled for
    them (a user's own, or a wrapper that holds reports back in its own ``poll``)."""
    while isinstance(sink, SinkWrapper):
        if type(sink).poll is not SinkWrapper.poll:
            return None
        sink = sink.inner
    return sink.wake if isinstance(sink, Signals) else None


class CurrentSink:
    """A relay's sink of the moment: none before it starts, replaced when it is unhealthy. The
    parts that send to it, poll it or look at it call this for it; the relay puts one in."""

    __slots__ = ("sink",)

    def __init__(self) -> None:
        self.sink: Sink | None = None

    def __call__(self) -> Sink | None:
        return self.sink


class SinkWrapper:
    """A sink that delegates to ``inner``; override ``produce`` to observe or alter sends.

    The base for sink middleware (timing, fault injection, filtering) without
    repeating the delegation of ``poll``/``flush``/``healthy``/``close``.
    """

    def __init__(self, inner: Sink) -> None:
        self.inner = inner

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        return self.inner.produce(event, report)

    def poll(self, timeout: float) -> int | None:
        return self.inner.poll(timeout)

    def flush(self, timeout: float) -> int:
        return self.inner.flush(timeout)

    def send_now(self) -> None:
        send_now(self.inner)

    def healthy(self) -> bool:
        return self.inner.healthy()

    def close(self, timeout: float) -> None:
        self.inner.close(timeout)
