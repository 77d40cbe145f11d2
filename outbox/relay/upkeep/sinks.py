"""The sinks' upkeep: replaced when unhealthy, chained where they cannot keep a key's order,
probed while down, and the events that failed only to reach them made due at once when they
answer again."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from outbox.relay.lanes import Lane, RelayStats
from outbox.relay.metrics import RelayMetrics
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.upkeep.chores import Chores
from outbox.sinks import router
from outbox.sinks.base import UNREACHABLE_KINDS, Reachable, Sink, keeps_key_order
from outbox.sinks.chains import KeyChains
from outbox.store.queries import query

log = logging.getLogger("outbox.relay")

RETRIES_PER_STEP = 8  # outboxes whose failures are made due at once after an outage, a loop step


class SinkUpkeep:
    """``sink``: the relay's sink now; ``make``: a new one (the relay's factory); ``use``: the relay
    takes a new sink on; ``chains``: each outbox's key chains, which the dispatcher wraps sends in;
    ``await_finishers`` and ``settle_unreported``: the finisher's, as a sink is replaced."""

    def __init__(
        self,
        chores: Chores,
        scheduler: ClaimScheduler,
        stats: RelayStats,
        metrics: RelayMetrics,
        *,
        sink: Callable[[], Sink | None],
        make: Callable[[], Sink],
        use: Callable[[Sink], None],
        chains: dict[str, KeyChains],
        await_finishers: Callable[[], None],
        settle_unreported: Callable[[], None],
    ) -> None:
        self.sink = sink
        self._make = make
        self._use = use
        self.chains = chains
        self.chores = chores
        self.scheduler = scheduler
        self._await_finishers = await_finishers
        self._settle_unreported = settle_unreported
        self.stats = stats
        self.metrics = metrics
        self.sinks_up = True  # every sink answered the last probe
        self.after_outage = False  # some outbox's failures wait for the sinks to answer again

    def next_at(self) -> float:
        """The outboxes' failures wait to be made due (a few a step) until the sinks answer."""
        return 0.0 if self.after_outage and self.sinks_up else float("inf")

    def due(self, now: float) -> None:
        self.retry_after_outage()

    def replace_sink(self) -> None:
        """A new sink from the factory; the unhealthy one's in-flight batches settled first."""
        old = self.sink()
        if old is not None:
            self._await_finishers()
            self.stats.sinks_replaced += 1
            self.metrics.sinks_replaced.inc()
            rotation = self.scheduler.rotation
            log.error(
                "sink unhealthy, replacing it; settling %d in-flight batches",
                sum(len(lane.in_flight) for lane in rotation),
                extra={"event": "sink.replaced"},
            )
            # The old client reports what it can (Kafka: what was acked, and its purged messages
            # as failed) and goes. The in-flight batches are then finished, not rolled back: what
            # was delivered is archived once, not sent again by the next claim; the rest counts
            # as failed for an unreachable sink (the key holds its later events, per-key order),
            # due again as soon as the replacement answers (sinks_back), not after a backoff.
            old.close(0)
            self._settle_unreported()
            self.sinks_were_down()
        self._use(self._make())
        self.chains.clear()
        for lane in self.scheduler.rotation:
            self.chain(lane)

    def chain(self, lane: Lane) -> None:
        """A sink that cannot order a key's in-flight events gets key chains, one set per outbox:
        keys are an outbox's own, and one outbox's failure must not hold another's events. A
        router over several sinks gets them too, across its sinks: a key's event waits for the
        key's events in flight to another sink (chains.py)."""
        sink = self.sink()
        assert sink is not None
        inner = router.unwrap(sink)
        if lane.ordering.ordered and not keeps_key_order(inner):
            route = inner.destination if isinstance(inner, router.Router) else None
            self.chains[lane.name] = KeyChains(sink, parks=lane.ordering.parks, route=route)

    def sinks_were_down(self) -> None:
        """A sink was down: every outbox's events that failed only for that are due at once when
        every sink answers again (:meth:`retry_after_outage`)."""
        for lane in self.scheduler.rotation:
            lane.upkept.sinks_were_down = True
        self.after_outage = True

    def sinks_back(self) -> None:
        """With the membership heartbeat (every few seconds): probe the sinks counted down; while
        one is, every outbox's failures for it wait to be retried at once when it answers."""
        sink = self.sink()
        if sink is None:
            return
        down = False
        for each in router.sinks_of(sink):
            inner = router.unwrap(each)
            if isinstance(inner, Reachable) and inner.trouble():
                inner.probe()
                down = down or bool(inner.trouble())
        self.sinks_up = not down
        if down:
            self.scheduler.sinks_seen_down = time.monotonic()
            self.sinks_were_down()

    def retry_after_outage(self) -> None:
        """Every sink answers again after an outage: the events of each outbox that failed only to
        reach them are due now, not after their backoff (a few outboxes a loop step)."""
        if not (self.after_outage and self.sinks_up):
            return
        waiting = [lane for lane in self.scheduler.rotation if lane.upkept.sinks_were_down]
        for lane in waiting[:RETRIES_PER_STEP]:
            self._retry_unreachable_now(lane)
        if len(waiting) <= RETRIES_PER_STEP:
            self.after_outage = any(lane.upkept.sinks_were_down for lane in waiting)

    def _retry_unreachable_now(self, lane: Lane) -> None:
        n = self.chores.on_session(
            lane,
            "retrying after the outage",
            lambda conn: (
                conn.execute(
                    query("retry_unreachable_now", lane.schema), {"kinds": sorted(UNREACHABLE_KINDS)}
                ).rowcount
            ),
        )
        if n is None:
            return
        lane.upkept.sinks_were_down = False
        if n > 0:
            log.info(
                "sinks answer again: %d events that failed to reach them are due now",
                n,
                extra={"outbox": lane.name},
            )
            lane.wake.notified()
