"""What a batch did, recorded in one place: its spans, metrics, counters and log lines."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from outbox.observe import tracing
from outbox.relay.batch import Batch, BatchResult
from outbox.relay.lanes import Lane, RelayStats
from outbox.relay.metrics import RelayMetrics
from outbox.sinks import router
from outbox.sinks.base import EXPIRED, Sink

if TYPE_CHECKING:
    from collections.abc import Callable

log = logging.getLogger("outbox.relay")


class BatchRecorder:
    """The relay's counters (``stats``: every outbox's; each lane has its own) and metrics
    (``metrics_on``: when someone reads them), fed from each batch's result."""

    def __init__(self, stats: RelayStats, metrics: RelayMetrics, metrics_on: Callable[[], bool]) -> None:
        self.stats = stats
        self.metrics = metrics
        self.metrics_on = metrics_on
        self.last_claim = time.monotonic()  # when a claim last went through (the stall watchdog's)

    def claim(self, lane: Lane, events: int) -> None:
        """A claim of ``lane`` went through (or a WAL batch was taken), with ``events`` (0: empty)."""
        stats = self.stats
        stats.claims += 1
        stats.claimed += events
        lane.stats.claims += 1
        lane.stats.claimed += events
        self.last_claim = time.monotonic()

    def record(
        self, lane: Lane, batch: Batch, result: BatchResult, ack_start: int, sink: Sink | None
    ) -> None:
        """Spans, metrics, counters and logs of a committed batch, from its result."""
        if batch.spans:
            errors = {t: next(iter(r.errors)) for t, r in result.topics.items() if r.errors}
            tracing.end_batch(batch.spans, errors, ack_start, time.time_ns())
        metrics = self.metrics if self.metrics_on() else None
        for topic, r in result.topics.items():
            for stats in (self.stats, lane.stats):
                stats.delivered += r.delivered
                stats.retried += r.retried
                stats.dead += r.dead
            if metrics is None:
                continue
            labels = (lane.name, topic, "none" if sink is None else router.name_of(sink, topic))
            if r.delivered:
                metrics.delivered.inc(labels, r.delivered)
                if r.commit_latencies:
                    metrics.latency.observe_many(r.commit_latencies, (lane.name, "commit"))
                if r.latencies:
                    metrics.latency.observe_many(r.latencies, (lane.name, "created"))
            for transform, n in r.filtered.items():
                metrics.filtered.inc((lane.name, topic, transform), n)
            for kind, n in r.errors.items():
                metrics.errors.inc((*labels, kind), n)
            if r.dead:
                metrics.dead.inc(labels, r.dead)
            if EXPIRED in r.errors:
                metrics.expired.inc((lane.name, topic), r.errors[EXPIRED])
        for ahead, earlier in result.overtaken:
            # Never expected: the sinks keep a key's failures a suffix of what is in flight
            # (docs/ordering.md). Said per event, as each is a break of the promise.
            log.error(
                "per-key order broken: event %s was delivered ahead of event %s of its key, which "
                "failed and will be retried after it",
                ahead,
                earlier,
                extra={"event": "order.violated", "outbox": lane.name},
            )
        if result.overtaken and metrics is not None:
            metrics.key_order_violations.inc((lane.name,), len(result.overtaken))
        for event_id, reason in result.dead_events:
            log.warning(
                "event %d dead-lettered: %s",
                event_id,
                reason,
                extra={"event": "event.dead", "outbox": lane.name},
            )
        retried = sum(r.retried for r in result.topics.values())
        settled = sum(r.delivered + r.dead for r in result.topics.values())
        if settled:
            lane.failing_since = 0.0
        elif retried and not lane.failing_since:
            lane.failing_since = batch.claimed_at  # every attempt of the batch failed
        if retried:
            kinds = sorted({kind for r in result.topics.values() for kind in r.errors})
            lane.delivery.fail(f"{retried} events of the last batch will be retried ({', '.join(kinds)})")
        elif any(r.delivered for r in result.topics.values()):
            lane.delivery.ok()

    def lease_lost(self, lane: Lane, batch: Batch, why: str, ack_start: int) -> None:
        self.stats.leases_lost += 1
        lane.stats.leases_lost += 1
        self.metrics.leases_lost.inc((lane.name,))
        self.end_spans(batch, ack_start, "lease_lost")
        log.warning(
            "ack of %d events refused, they will be delivered again by their new owner: %s",
            batch.size,
            why,
            # How long the batch was out: every event of it was sent within that time.
            extra={
                "event": "lease.lost",
                "outbox": lane.name,
                "batch_age": round(time.monotonic() - batch.claimed_at, 3),
            },
        )

    @staticmethod
    def end_spans(batch: Batch, ack_start: int, error: str) -> None:
        if batch.spans:
            tracing.end_batch(batch.spans, {}, ack_start, time.time_ns(), error)
            batch.spans = {}
