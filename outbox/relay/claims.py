"""The step's claim: which outbox claims now (the scheduler says), and through which intake: a
limit's (``--limit``), a WAL lane's, one outbox's table alone, or several outboxes' tables in one
transaction, their next claims sent ahead."""

from __future__ import annotations

import time
from collections.abc import Callable

from outbox.relay.gated import GateIntake
from outbox.relay.intake import Intake, Picks
from outbox.relay.lanes import Lane
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.wal_intake import WalIntake


class ClaimStep:
    """``per_lane``: batches of one outbox in flight at most (``--max-batches-in-flight``);
    ``free``: would a session be free now (within the budget)?"""

    def __init__(
        self,
        scheduler: ClaimScheduler,
        intake: Intake,
        gated: GateIntake,
        wal: WalIntake,
        *,
        per_lane: int,
        free: Callable[[], bool],
    ) -> None:
        self.scheduler = scheduler
        self.intake = intake
        self.gated = gated
        self.wal = wal
        self.per_lane = per_lane
        self._free = free

    def claim_ahead(self) -> bool:
        """The claims sent during the last step (outbox.pipelined), their rows taken now; False:
        none were sent."""
        ahead = self.intake.ahead
        if ahead is None:
            return False
        self._claim_shared(ahead.picks)
        return True

    def claim(self, lane: Lane, now: float) -> int | None:
        """A claim of ``lane``, the one the scheduler chose: how many events it took (-1: shared
        claims that failed; None: a limit's claim, which says nothing of the outbox's backlog)."""
        scheduler = self.scheduler
        gate = lane.gate_due(now, self.per_lane) if lane.gates else None  # (limits: --limit)
        if gate is not None:
            self.gated.claim_gate(lane, gate, scheduler.batch_limit(lane, now))
            return None
        group = self._shareable([lane, *scheduler.companions(lane, now)])
        limit = self._claiming(lane, now)
        if len(group) > 1 and group[0] is lane:
            picks = [(lane, limit)] + [(c, self._claiming(c, now, companion=True)) for c in group[1:]]
            return self._claim_shared(picks)
        intake = self.wal if lane.wal is not None else self.intake
        claimed = intake.claim_and_send(lane, limit)
        scheduler.claimed(lane, limit, claimed)
        return claimed

    def _claim_shared(self, picks: Picks) -> int:
        """The claims of ``picks`` in one transaction, sent now or (the intake's ``ahead``) during
        the last step; how many events they took (-1: they failed)."""
        counts = self.intake.claim_shared(picks, self._next_claims)
        if counts is None:  # failed: each claims again soon (alone, after an outbox's error)
            for lane, _ in picks:
                self.scheduler.claim_again(lane)
            return -1
        for (lane, most), count in zip(picks, counts, strict=True):
            self.scheduler.claimed(lane, most, count)
        return sum(counts)

    def _next_claims(self) -> Picks:
        """The next claim's outboxes and limits, to send ahead (ClaimScheduler.ahead), in the
        order and with the limits the step would give them."""
        now = time.monotonic()
        lanes = self.scheduler.ahead(now, self._free())
        group = self._shareable(lanes)
        if not group or group[0] is not lanes[0]:
            return []
        lead, *others = group
        return [(lead, self._claiming(lead, now))] + [
            (c, self._claiming(c, now, companion=True)) for c in others
        ]

    @staticmethod
    def _shareable(lanes: list[Lane]) -> list[Lane]:
        """Those of ``lanes`` that may claim in a shared transaction: outboxes whose events are in
        their table (capture mode known; no WAL reader, whose batches commit in the order read)."""
        return [lane for lane in lanes if lane.wal is None and lane.upkept.capture_mode == "table"]

    def _claiming(self, lane: Lane, now: float, companion: bool = False) -> int:
        """``lane`` claims now: what woke it is taken, and its claim's limit returned."""
        if lane.wake.woken or now >= lane.next_poll:
            for g in lane.gates:  # a NOTIFY or a poll: a limit's events may wait too
                g.pending = True
        if lane.wake.table_news:  # rows were inserted into its events table
            lane.wake.table_news = False
            if lane.wal is not None:  # WAL capture: its table takes its next turn
                self.wal.table_news(lane)
        lane.wake.woken = False  # a NOTIFY arriving during the claim sets it again
        scheduler = self.scheduler
        scheduler.taking(lane, now)
        return scheduler.companion_limit(lane, now) if companion else scheduler.batch_limit(lane, now)
