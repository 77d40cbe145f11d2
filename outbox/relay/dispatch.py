"""The dispatcher: a batch's events handed to the sink, and the batch into the ledger.

The intake claims a batch (or takes one from the WAL) and hands it on here; the outcomes come back
through ``Batch.settle``, and the finisher takes it from there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any, cast

from outbox.events import ClaimedEvent
from outbox.observe import tracing
from outbox.relay.batch import Batch
from outbox.relay.lanes import Lane
from outbox.relay.ledger import Ledger
from outbox.relay.metrics import RelayMetrics
from outbox.sinks import router
from outbox.sinks.base import Sink, many_of, send_now
from outbox.sinks.chains import KeyChains
from outbox.transform import Transforms


class Dispatcher:
    """Sends batches. ``sink``: the relay's sink now (it is replaced when unhealthy); ``chains``:
    each outbox's key chains (SinkUpkeep's); ``metrics_on``: whether metrics are kept."""

    def __init__(
        self,
        ledger: Ledger,
        metrics: RelayMetrics,
        transforms: Transforms,
        *,
        sink: Callable[[], Sink | None],
        chains: dict[str, KeyChains],
        metrics_on: Callable[[], bool],
    ) -> None:
        self.ledger = ledger
        self.metrics = metrics
        self.transforms = transforms
        self._sink = sink
        self.chains = chains
        self._metrics_on = metrics_on

    def send(self, lane: Lane, batch: Batch, claim_start: int, limit: int, flush: bool = True) -> int:
        """Hand a batch's events to the sink (their outcomes come back through ``batch.settle``)."""
        sink = self._sink()
        assert sink is not None
        ordering = lane.ordering
        if batch.expiring:  # before anything else: an expired event is neither sent nor transformed
            batch.expire(time.time())
        if self.transforms:  # before routing: a transform may re-route, re-key or drop an event
            batch.transform(self.transforms)
        batch.spans = tracing.start_batch(
            batch.events, claim_start, time.time_ns(), partial(_span_shape, sink, lane.name)
        )
        size = batch.size
        if self._metrics_on():
            self.metrics.batch_size.observe(size, (lane.name,))
        # Per-key order: once an event of key K fails (in this batch or in one
        # still in flight), K's later events are held: left pending, untouched.
        # When the failure is committed, the claim query blocks them instead.
        held = ordering.holds.keys if ordering.ordered else None
        events = batch.events
        start = 0
        chains = self.chains.get(lane.name)
        # A lane with key chains goes through them, event by event: never around them.
        many = many_of(sink) if chains is None and not held and batch.waiting == size else None
        if many is not None:
            # Nothing held, nothing corrupt: the batch goes to the sink in one call
            # (KafkaSink.produce_many), up to the first event the sink does not take as it is.
            start = many.produce_many(cast("list[ClaimedEvent]", events), batch.outcomes, batch.settle)
        produce = chains.produce if chains is not None else sink.produce
        for i in range(start, size):
            event = events[i]
            if event is None or batch.outcomes[i] is not None:  # corrupt (dead), or held before
                continue
            if held and (key := batch.key(i)) is not None and key in held:
                batch.hold(i)
                continue
            outcome = produce(event, partial(batch.settle, i))
            if outcome is not None:
                batch.settle(i, outcome)
        self.ledger.sent(lane, batch)
        if not flush:  # one of several batches sent together: the caller sends them
            return size
        # (WAL capture: a batch cut short by a transaction's end is no sign of an idle outbox
        # while the reader holds a full batch more; "anything waiting" was too broad, as
        # docs/decisions/0004-wal-capture.md says.)
        if size < limit and not (lane.wal is not None and lane.wal.queued >= limit):
            # No backlog behind this batch, nothing to batch it with: send it without waiting
            # out the client's linger (Kafka). A full batch lingers, and batches on the wire.
            send_now(sink)
        sink.poll(0)  # sinks that queue what they were given send it now, as one burst
        return size

    def flush(self, short: bool) -> None:
        """Batches sent together (``send(flush=False)``) go out: at once when one was short (one
        wait for the acks of them all), else as the client batches them."""
        sink = self._sink()
        assert sink is not None
        if short:
            send_now(sink)
        sink.poll(0)


def _span_shape(sink: Sink, outbox: str, topic: str) -> tuple[str, dict[str, Any]]:
    name, attributes = router.shape_of(sink, topic)
    return name, {**attributes, "outbox.name": outbox}
