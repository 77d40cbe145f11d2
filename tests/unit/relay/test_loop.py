"""outbox.relay.loop.Loop: one step, with its parts as fakes that record what they were asked,
a sink that signals or not, and the one wait recorded instead of slept (no database, no broker,
no clock waited on)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Beats, Lane
from outbox.relay.ledger import Ledger
from outbox.relay.loop import REPORT_WAIT, Loop, Wakeup
from outbox.relay.scheduler import ClaimScheduler, Pick
from tests.unit.relay.lanes import a_lane


@dataclass
class _Event:
    """The loop's one wait, recorded: how long it would have slept each time."""

    waits: list[float] = field(default_factory=list)
    is_on: bool = False

    def set(self) -> None:
        self.is_on = True

    def clear(self) -> None:
        self.is_on = False

    def is_set(self) -> bool:
        return self.is_on

    def wait(self, timeout: float) -> bool:
        self.waits.append(timeout)
        return self.is_on


@dataclass
class _Sink:
    polls: list[float] = field(default_factory=list)
    up: bool = True

    def poll(self, timeout: float) -> int:
        self.polls.append(timeout)
        return 0

    def healthy(self) -> bool:
        return self.up


@dataclass
class _Parts:
    """Each part the step calls, and what it was asked, in order."""

    asked: list[str] = field(default_factory=list)
    claimed: int = 0  # events each claim takes
    changed: bool = False
    finishing: dict[Any, Any] = field(default_factory=dict)
    finisher_work: bool = False  # what the finisher says when asked (to_finish)
    complete: list[int] = field(default_factory=list)  # the complete batches it was told of

    def apply(self) -> None:
        self.asked.append("roster")

    def to_finish(self, complete: int) -> bool:
        self.complete.append(complete)
        return self.finisher_work

    def finish_complete(self) -> None:
        self.asked.append("finish")

    def replace_sink(self) -> None:
        self.asked.append("replace sink")

    def due(self, now: float | None = None) -> None:
        self.asked.append("due")

    def next_at(self) -> float:
        return float("inf")

    def claim_ahead(self) -> bool:
        return False

    def claim(self, pick: Pick, now: float) -> int:
        self.asked.append(f"claim {pick.lane.name}")
        return self.claimed


def _loop(signals: bool) -> tuple[Loop, Lane, _Parts, _Sink, _Event]:
    scheduler = ClaimScheduler(RelayConfig("postgresql://unused"), Beats())
    lane = a_lane("o", "s")
    member = lane.ordering.member
    lane.next_poll = time.monotonic() + 60  # not due unless woken
    lane.more_work = lane.wake.woken = False
    scheduler.add(lane)
    parts = _Parts()
    sessions = SimpleNamespace(available=lambda: True, give_back=lambda conn: None)
    ledger = Ledger(cast(Any, sessions), cast(Any, None), cast(Any, member), scheduler)
    upkeep = SimpleNamespace(
        due=parts.due, next_at=parts.next_at, sinks=SimpleNamespace(replace_sink=parts.replace_sink)
    )
    sink = _Sink()
    wakeup = Wakeup()
    event = _Event()
    wakeup.use(cast(Any, event) if signals else None)
    if not signals:
        wakeup.event = cast(Any, event)
    loop = Loop(
        cast(Any, sessions), scheduler, ledger, cast(Any, parts), cast(Any, parts), cast(Any, parts),
        cast(Any, upkeep), cast(Any, parts), wakeup, sink=lambda: cast(Any, sink), reported=lambda: None,
    )  # fmt: skip
    return loop, lane, parts, sink, event


def test_an_idle_step_finishes_beats_upkeeps_and_then_waits_in_one_place() -> None:
    loop, _, parts, sink, event = _loop(signals=True)
    loop.step()
    assert parts.asked == ["due", "due"]  # the heartbeats, the upkeep (the finisher has no work)
    assert sink.polls == [0] and len(event.waits) == 1 and event.waits[0] > 1  # until the next poll


def test_a_woken_outbox_is_claimed_and_nothing_waits() -> None:
    loop, lane, parts, _, event = _loop(signals=True)
    lane.wake.notified()
    loop.step()
    assert parts.asked[-1] == "claim o" and event.waits == []


def test_an_empty_claim_behind_batches_in_flight_waits_for_a_report_not_each_notify() -> None:
    """Signalled: the next claim waits until a report comes (or REPORT_WAIT); polled: the sink is
    polled that long at once."""
    loop, lane, parts, _, event = _loop(signals=True)
    lane.in_flight.append(cast(Any, SimpleNamespace(waiting=1)))
    loop.ledger.busy[lane] = None
    lane.wake.notified()
    loop.step()
    assert parts.asked[-1] == "claim o"
    lane.wake.notified()
    loop.step()  # no report since: no claim, a wait of at most REPORT_WAIT
    assert parts.asked.count("claim o") == 1 and 0 < event.waits[-1] <= REPORT_WAIT
    polled, lane2, parts2, sink2, _ = _loop(signals=False)
    lane2.in_flight.append(cast(Any, SimpleNamespace(waiting=1)))
    polled.ledger.busy[lane2] = None
    lane2.wake.notified()
    polled.step()
    assert parts2.asked[-1] == "claim o" and sink2.polls == [REPORT_WAIT]


def test_an_unhealthy_sink_is_replaced_before_anything_is_claimed() -> None:
    loop, lane, parts, sink, _ = _loop(signals=False)
    sink.up = False
    lane.wake.notified()
    loop.step()
    assert parts.asked.index("replace sink") < parts.asked.index("claim o")


def test_a_batch_leaving_lifts_the_wait_an_empty_claim_behind_it_began() -> None:
    """Its rows' locks and key holds go with it: the woken outbox claims at the next step. Before,
    only a report lifted it, and with none left to come the loop ran step after step, waiting
    for nothing, until REPORT_WAIT was out (13,000 steps a second at 500 events/s)."""
    loop, lane, parts, _, event = _loop(signals=True)
    batch = cast(Any, SimpleNamespace(waiting=0, gate=None, shared=None, conn=None))
    loop.ledger.sent(lane, batch)
    lane.wake.notified()
    loop.step()  # empty (its events went with the batch in flight): wait for news of it
    lane.wake.notified()
    loop.step()
    assert parts.asked.count("claim o") == 1 and 0 < event.waits[-1] <= REPORT_WAIT
    loop.ledger.leave(lane, batch)
    lane.wake.notified()
    loop.step()
    assert parts.asked.count("claim o") == 2


def test_an_outbox_woken_while_it_rests_is_waited_for_not_stepped_for() -> None:
    """An error of its own rests it; a NOTIFY meanwhile must not make every step return at once."""
    loop, lane, parts, _, event = _loop(signals=True)
    lane.pause("claim failed: permission denied", rest=2.0)
    lane.wake.notified()
    loop.step()
    assert "claim o" not in parts.asked
    assert len(event.waits) == 1 and 1.5 < event.waits[0] <= 2.0  # until its rest is over


def test_the_finisher_walks_its_batches_only_when_it_says_it_has_work() -> None:
    """The step tells the finisher how many batches in flight await no report; it walks them
    (finish_complete) only when it has work: a batch to hand over, or one finished since."""
    loop, lane, parts, _, _ = _loop(signals=True)
    loop.ledger.sent(lane, cast(Any, SimpleNamespace(waiting=0, gate=None, shared=None, conn=None)))
    loop.ledger.sent(lane, cast(Any, SimpleNamespace(waiting=2, gate=None, shared=None, conn=None)))
    loop.step()
    assert parts.complete == [1] and "finish" not in parts.asked
    parts.finisher_work = True
    loop.step()
    assert parts.complete == [1, 1] and parts.asked.count("finish") == 1
