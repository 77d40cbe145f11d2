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

Across sinks (a :class:`~outbox.sinks.router.Router` with routes to more than
one), the chain is the key's, not the sink's: with ``route``, a key's next
event joins the ones in flight only when it goes to the same sink and that
sink keeps a key's in-flight order (Kafka); otherwise it waits until they are
all delivered. Without that, a key's event on Kafka went out while the key's
earlier event to a RabbitMQ that was down had not failed yet: the later event
overtook the earlier one's failure whenever the failure came back after the
send, and was held behind it whenever it came back before.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from functools import partial

from outbox.events import ClaimedEvent
from outbox.sinks.base import HELD, Dead, Delivered, Outcome, Report, Retry, Sink, SinkWrapper

# An event's destination for its key's chain: the sink it goes to (any identity), and whether that
# sink keeps the order of a key's in-flight events (several may then be in flight at once).
Route = Callable[[ClaimedEvent], tuple[object, bool]]


class _Chain:
    """One key's events: how many are in flight (and where), and the ones waiting behind them."""

    __slots__ = ("flying", "keeps", "queue", "sink")

    def __init__(self) -> None:
        self.flying = 0
        self.sink: object = None
        self.keeps = False
        self.queue: deque[tuple[ClaimedEvent, Report]] = deque()


class KeyChains(SinkWrapper):
    """``inner`` with at most one event per key in flight, or, with ``route``, several only while
    they all go to one sink that keeps their order."""

    def __init__(self, inner: Sink, *, parks: bool, route: Route | None = None) -> None:
        super().__init__(inner)
        self._parks = parks
        self._route = route
        # key -> its chain (a key is present exactly while one of its events is in flight).
        self._chains: dict[bytes, _Chain] = {}

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        key = event.key
        if key is None:
            return self.inner.produce(event, report)
        chain = self._chains.get(key)
        to = None
        if chain is None:
            chain = self._chains[key] = _Chain()
        elif chain.queue or (to := self._joining(chain, event)) is None:
            chain.queue.append((event, report))
            return None
        outcome = self._send(key, chain, event, report, to)
        if outcome is not None:
            self._ended(key, chain, outcome)
        return outcome

    def _joining(self, chain: _Chain, event: ClaimedEvent) -> tuple[object, bool] | None:
        """``event``'s destination when it may go out beside its key's events in flight, else None."""
        if self._route is None or not chain.keeps:
            return None
        to = self._route(event)
        return to if to[0] is chain.sink else None

    def _send(
        self, key: bytes, chain: _Chain, event: ClaimedEvent, report: Report, to: tuple[object, bool] | None
    ) -> Outcome | None:
        """Hand ``event`` to the sink; ``to``: its destination, when already looked up."""
        chain.flying += 1
        if self._route is not None:
            chain.sink, chain.keeps = to or self._route(event)
        outcome = self.inner.produce(event, partial(self._settled, key, chain, report))
        if outcome is not None:
            chain.flying -= 1
        return outcome

    def _settled(self, key: bytes, chain: _Chain, report: Report, outcome: Outcome) -> None:
        report(outcome)  # first: a failure adds the relay's key hold before the chain moves on
        chain.flying -= 1
        self._ended(key, chain, outcome)

    def _ended(self, key: bytes, chain: _Chain, outcome: Outcome) -> None:
        """One of the key's events ended with ``outcome``: send what may go next, or hold them all."""
        queue = chain.queue
        while True:
            if self._holds_key(outcome):
                for _, report in queue:
                    report(HELD)
                queue.clear()
            to = None
            if chain.flying and (not queue or (to := self._joining(chain, queue[0][0])) is None):
                return  # the rest of its events in flight report later, and continue the chain
            if not queue:
                if self._chains.get(key) is chain:  # (not after close(): a report that came late)
                    del self._chains[key]
                return
            event, report = queue.popleft()
            sent = self._send(key, chain, event, report, to)
            if sent is not None:
                report(sent)
                outcome = sent
            # in flight: the next one may join it (same sink, kept in order), or waits for its report

    def _holds_key(self, outcome: Outcome) -> bool:
        if type(outcome) is Delivered:
            return False
        return isinstance(outcome, Retry) or (self._parks and isinstance(outcome, Dead))

    def queued(self) -> int:
        return sum(len(c.queue) for c in self._chains.values())

    def flush(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            left = self.inner.flush(max(0.0, deadline - time.monotonic()))
            queued = self.queued()
            if not queued or time.monotonic() >= deadline:
                return left + queued

    def close(self, timeout: float) -> None:
        self.inner.close(timeout)
        self._chains.clear()
