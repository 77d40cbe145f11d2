"""Per-key chains: one event of a key in flight at a time, for sinks that cannot order more.

Kafka's idempotent producer keeps the order of many in-flight messages of one
partition, and a failure fails the ones behind it. RabbitMQ, NATS, Redis and
HTTP give no such promise: a later publish can succeed where an earlier one of
the same key failed. So for those sinks the relay sends a key's events one at a
time: the next event of a key is handed to the sink only when the previous one
is delivered. When it fails in a way that holds the key (a retry; a dead letter
under ``--on-dead park``), every event queued behind it is answered
:data:`~outbox.sinks.base.HELD` — left pending, untouched — and the relay's key
holds and claim query keep them back until the failure is committed and its
backoff has passed.

Parallelism comes from many keys: a batch of 1,000 events over 1,000 keys is
1,000 concurrent sends. Events without a key carry no order and are never
chained.
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial

from outbox.events import ClaimedEvent
from outbox.sinks.base import HELD, Dead, Delivered, Outcome, Report, Retry, Sink, SinkWrapper


class KeyChains(SinkWrapper):
    """``inner`` with at most one event per key in flight."""

    def __init__(self, inner: Sink, *, parks: bool) -> None:
        super().__init__(inner)
        self._parks = parks
        # key -> the events waiting behind the key's one in-flight event
        # (a key is present exactly while one of its events is in flight).
        self._queued: dict[bytes, deque[tuple[ClaimedEvent, Report]]] = {}

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        key = event.key
        if key is None:
            return self.inner.produce(event, report)
        queue = self._queued.get(key)
        if queue is not None:
            queue.append((event, report))
            return None
        self._queued[key] = deque()
        outcome = self.inner.produce(event, partial(self._settled, key, report))
        if outcome is not None:
            self._next(key, outcome)
        return outcome

    def _settled(self, key: bytes, report: Report, outcome: Outcome) -> None:
        report(outcome)  # first: a failure adds the relay's key hold before the chain moves on
        self._next(key, outcome)

    def _next(self, key: bytes, outcome: Outcome) -> None:
        """The key's in-flight event ended with ``outcome``: send the next one, or hold them all."""
        queue = self._queued[key]
        while True:
            if self._holds_key(outcome):
                for _, report in queue:
                    report(HELD)
                queue.clear()
            if not queue:
                del self._queued[key]
                return
            event, report = queue.popleft()
            sent = self.inner.produce(event, partial(self._settled, key, report))
            if sent is None:
                return  # in flight: its report continues the chain
            report(sent)
            outcome = sent

    def _holds_key(self, outcome: Outcome) -> bool:
        if type(outcome) is Delivered:
            return False
        return isinstance(outcome, Retry) or (self._parks and isinstance(outcome, Dead))

    def queued(self) -> int:
        return sum(len(q) for q in self._queued.values())

    def flush(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            left = self.inner.flush(max(0.0, deadline - time.monotonic()))
            queued = self.queued()
            if not queued or time.monotonic() >= deadline:
                return left + queued

    def close(self, timeout: float) -> None:
        self.inner.close(timeout)
        self._queued.clear()
