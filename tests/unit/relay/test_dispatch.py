"""outbox.relay.dispatch.Dispatcher: a batch's events handed to the sink and the batch into the
ledger, with a sink that records what it was given (no database, no broker)."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from outbox.events import ClaimedEvent
from outbox.relay.batch import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.dispatch import Dispatcher
from outbox.relay.lanes import Beats, Lane
from outbox.relay.ledger import Ledger
from outbox.relay.metrics import RelayMetrics
from outbox.relay.scheduler import ClaimScheduler
from outbox.sinks.base import Delivered, Report
from tests.unit.relay.lanes import a_lane


@dataclass
class _Sink:
    """Takes events and reports later; ``sent_now``: how often it was told not to linger."""

    produced: list[str] = field(default_factory=list)
    reports: list[Report] = field(default_factory=list)
    sent_now: int = 0
    polled: int = 0

    def produce(self, event: ClaimedEvent, report: Report) -> None:
        self.produced.append(event.event_id)
        self.reports.append(report)

    def send_now(self) -> None:
        self.sent_now += 1

    def poll(self, timeout: float) -> int:
        self.polled += 1
        return 0

    def flush(self, timeout: float) -> int:
        return 0

    def healthy(self) -> bool:
        return True

    def close(self, timeout: float) -> None:
        pass


def _setup() -> tuple[Dispatcher, Ledger, Lane, _Sink]:
    config = RelayConfig("postgresql://unused")
    scheduler = ClaimScheduler(config, Beats())
    lane = a_lane("o", "s")
    member = lane.ordering.member
    ledger = Ledger(cast(Any, SimpleNamespace()), cast(Any, None), cast(Any, member), scheduler)
    sink = _Sink()
    dispatcher = Dispatcher(
        ledger, RelayMetrics(), {}, sink=lambda: cast(Any, sink), chains={}, metrics_on=lambda: True
    )
    return dispatcher, ledger, lane, sink


def _batch(lane: Lane, keys: list[bytes]) -> Batch:
    rows = [(i, f"e{i}", "t", key, b"p", None, 1.0, 0, None, None, None, None) for i, key in enumerate(keys)]
    return Batch(cast(Any, "conn"), rows, holds=lane.ordering.holds)


def test_a_short_batch_goes_out_at_once_and_into_the_ledger() -> None:
    dispatcher, ledger, lane, sink = _setup()
    batch = _batch(lane, [b"a", b"b"])
    assert dispatcher.send(lane, batch, 0, limit=100) == 2
    assert sink.produced == ["e0", "e1"] and ledger.flights() == [(lane, batch)]
    assert sink.sent_now == 1 and sink.polled == 1  # not lingering: nothing more comes behind it
    sink.reports[0](Delivered())
    assert batch.outcomes[0] is not None and batch.outcomes[1] is None  # reports settle the batch


def test_a_full_batch_lingers_and_a_held_key_stays_behind() -> None:
    """A key held by a failure in flight keeps its later events out of the sink: they are held,
    left pending, untouched (per-key order)."""
    dispatcher, _, lane, sink = _setup()
    lane.ordering.holds.add(999, b"held")
    batch = _batch(lane, [b"a", b"held", b"b"])
    dispatcher.send(lane, batch, 0, limit=3)
    assert sink.produced == ["e0", "e2"] and sink.sent_now == 0
    assert batch.outcomes[1] is not None and batch.outcomes[0] is None


def test_batches_sent_together_go_out_with_one_flush() -> None:
    dispatcher, _, lane, sink = _setup()
    for keys in ([b"a"], [b"b"]):
        dispatcher.send(lane, _batch(lane, keys), 0, 100, False)
    assert sink.sent_now == 0 and sink.polled == 0
    dispatcher.flush(short=True)
    assert sink.sent_now == 1 and sink.polled == 1
