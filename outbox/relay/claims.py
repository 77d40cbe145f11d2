"""The step's claim: which outbox claims now (the scheduler says), and through which intake: a
limit's (``--limit``), a WAL lane's, one outbox's table alone, or several outboxes' tables in one
transaction, their next claims sent ahead."""

from __future__ import annotations

import time
from collections.abc import Callable

from outbox.relay.gated import GateIntake
from outbox.relay.intake import Intake, Picks
from outbox.relay.scheduler import ClaimScheduler, Pick
from outbox.relay.wal_intake import WalIntake


class ClaimStep:
    """``free``: would a session be free now (within the budget)?"""

    def __init__(
        self,
        scheduler: ClaimScheduler,
        intake: Intake,
        gated: GateIntake,
        wal: WalIntake,
        *,
        free: Callable[[], bool],
    ) -> None:
        self.scheduler = scheduler
        self.intake = intake
        self.gated = gated
        self.wal = wal
        self._free = free

    def claim_ahead(self) -> bool:
        """The claims sent during the last step (outbox.pipelined), their rows taken now; False:
        none were sent."""
        ahead = self.intake.ahead
        if ahead is None:
            return False
        self._claim_shared(ahead.picks)
        return True

    def claim(self, pick: Pick, now: float) -> int | None:
        """The claim the scheduler chose: how many events it took (-1: shared claims that failed;
        None: a limit's claim, which says nothing of the outbox's backlog)."""
        lane = pick.lane
        if pick.gate is not None:  # (limits: --limit)
            self.gated.claim_gate(lane, pick.gate, pick.limit)
            return None
        picks = self._taken(pick, now)
        if pick.companions:
            return self._claim_shared(picks)
        intake = self.wal if lane.wal is not None else self.intake
        claimed = intake.claim_and_send(lane, pick.limit)
        self.scheduler.claimed(lane, pick.limit, claimed)
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
        pick = self.scheduler.ahead(now, self._free())
        return [] if pick is None else self._taken(pick, now)

    def _taken(self, pick: Pick, now: float) -> Picks:
        """The outboxes of ``pick`` claim now, each with its limit: what woke each is taken."""
        picks = [(pick.lane, pick.limit), *pick.companions]
        for lane, _ in picks:
            if lane.wake.woken or now >= lane.next_poll:
                for g in lane.gates:  # a NOTIFY or a poll: a limit's events may wait too
                    g.pending = True
            if lane.wake.table_news:  # rows were inserted into its events table
                lane.wake.table_news = False
                if lane.wal is not None:  # WAL capture: its table takes its next turn
                    self.wal.table_news(lane)
            lane.wake.woken = False  # a NOTIFY arriving during the claim sets it again
        return picks
