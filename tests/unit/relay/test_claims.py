"""outbox.relay.claims.ClaimStep: which intake a claim goes through, with intakes that record
what they were asked (pure routing; no database)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from outbox.relay.claims import ClaimStep
from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Beats, Lane
from outbox.relay.limits import Limit, gates
from outbox.relay.scheduler import ClaimScheduler, Pick
from tests.unit.relay.lanes import a_lane


@dataclass
class _Intake:
    """An intake: each claim takes ``found`` events (the shared claims, each outbox's)."""

    found: int = 3
    asked: list[tuple[str, list[str]]] = field(default_factory=list)
    ahead: Any = None

    def claim_and_send(self, lane: Lane, limit: int) -> int:
        self.asked.append(("alone", [lane.name]))
        return self.found

    def claim_shared(self, picks: list[tuple[Lane, int]], next_claims: Any) -> list[int]:
        self.asked.append(("shared", [lane.name for lane, _ in picks]))
        return [self.found] * len(picks)

    def claim_gate(self, lane: Lane, gate: Any, most: int) -> int:
        self.asked.append(("gate", [lane.name, gate.limit.glob]))
        return self.found

    def table_news(self, lane: Lane) -> None:
        self.asked.append(("table news", [lane.name]))


def _step(n: int, **config: Any) -> tuple[ClaimStep, list[Lane], _Intake, _Intake, _Intake]:
    cfg = RelayConfig("postgresql://unused", **config)
    scheduler = ClaimScheduler(cfg, Beats())
    lanes = []
    for i in range(n):
        lane = a_lane(f"o{i}", f"s{i}")
        lane.upkept.capture_mode = "table"
        lane.wake.woken = True
        scheduler.add(lane)
        lanes.append(lane)
    intake, gated, wal = _Intake(), _Intake(), _Intake()
    step = ClaimStep(scheduler, cast(Any, intake), cast(Any, gated), cast(Any, wal), free=lambda: True)
    return step, lanes, intake, gated, wal


def _next(step: ClaimStep) -> Pick:
    pick = step.scheduler.next_claim(time.monotonic(), True)
    assert pick is not None
    return pick


def test_outboxes_due_together_claim_in_one_transaction_and_one_alone_by_itself() -> None:
    step, lanes, intake, _, _ = _step(3, shared_outboxes=8)
    assert step.claim(_next(step), time.monotonic()) == 9
    assert intake.asked == [("shared", ["o0", "o1", "o2"])]
    assert not any(lane.wake.woken for lane in lanes)  # what woke each is taken
    step, lanes, intake, _, _ = _step(1)
    assert step.claim(_next(step), time.monotonic()) == 3 and intake.asked == [("alone", ["o0"])]


def test_a_wal_lane_claims_through_its_own_intake_and_is_told_of_table_news() -> None:
    step, (lane,), intake, _, wal = _step(1)
    lane.wal = cast(Any, SimpleNamespace(waiting=False))
    lane.wake.table_news = True
    step.claim(_next(step), time.monotonic())
    assert wal.asked == [("table news", ["o0"]), ("alone", ["o0"])] and intake.asked == []


def test_a_limit_with_events_waiting_claims_through_the_gate_and_says_nothing_of_a_backlog() -> None:
    step, (lane,), intake, gated, _ = _step(1)
    lane.gates = gates([Limit("orders.*", rate=10.0, in_flight=None)])
    assert step.claim(_next(step), time.monotonic()) is None
    assert gated.asked == [("gate", ["o0", "orders.*"])] and intake.asked == []


def test_claims_sent_ahead_are_read_at_the_next_step_before_any_other() -> None:
    step, lanes, intake, _, _ = _step(2, shared_outboxes=8)
    assert not step.claim_ahead()
    intake.ahead = SimpleNamespace(picks=[(lanes[0], 100), (lanes[1], 100)])
    assert step.claim_ahead() and intake.asked == [("shared", ["o0", "o1"])]
