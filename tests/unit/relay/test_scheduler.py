"""outbox.scheduler.ClaimScheduler: which outbox claims next, how much, and pacing a slow sink.
Pure logic over the lanes' state and the clock: no database, no sink."""

from __future__ import annotations

import collections
import logging
import math
from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Beats, Lane
from outbox.relay.limits import Gate, gates, parse_limit
from outbox.relay.scheduler import FAIR_BATCH, MIN_CLAIM, QUIET_LOOK, START_CLAIM, ClaimScheduler
from outbox.sinks.base import Delivered, Retry
from outbox.store.outboxes import Outbox


@dataclass
class _Ordering:
    due_at: float = 1e9


@dataclass
class _Batch:
    """What pacing reads of a batch: its size, when it was claimed, its outcomes."""

    size: int
    claimed_at: float
    outcomes: list[Any] = field(default_factory=list)

    def __len__(self) -> int:
        return self.size


def _scheduler(**config: Any) -> ClaimScheduler:
    return ClaimScheduler(RelayConfig("postgresql://unused", **config), Beats())


def _lane(s: ClaimScheduler, name: str, **state: Any) -> Lane:
    lane = Lane(Outbox(name, "postgresql://unused", name), cast(Any, _Ordering()))
    lane.wake.woken = lane.more_work = False
    lane.next_poll = 1e9
    lane.pace.fresh = False  # claimed from already, unless a test says otherwise
    lane.upkept.capture_mode = "table"
    for k, v in state.items():
        if k == "woken":
            lane.wake.woken = v
        elif k == "claim_cap":
            lane.pace.cap = v
        else:
            setattr(lane, k, v)
    s.add(lane)
    return lane


def test_a_woken_outbox_goes_first_then_backlogs_in_turn_then_polls() -> None:
    s = _scheduler()
    a = _lane(s, "a", more_work=True)
    b = _lane(s, "b", more_work=True)
    c = _lane(s, "c", next_poll=0.0)
    d = _lane(s, "d", woken=True)
    assert s.choose(10.0, True) is d  # a NOTIFY first: a quiet outbox's latency
    d.wake.woken = False
    assert [s.choose(10.0, True) for _ in range(4)] == [a, b, a, b]  # backlogs take turns
    a.more_work = b.more_work = False
    assert s.choose(10.0, True) is c  # then the poll timer
    assert s.choose(10.0, False) is None  # no session free: nobody


def test_backlogs_share_claims_evenly() -> None:
    s = _scheduler()
    lanes = [_lane(s, name, more_work=True) for name in "abcde"]
    got = collections.Counter(s.choose(1.0, True) for _ in range(500))
    assert set(got.values()) == {100} and set(got) == set(lanes)


def test_an_outbox_without_a_slot_or_paused_or_leaving_is_passed_over() -> None:
    s = _scheduler(max_batches_in_flight=2)
    full = _lane(s, "full", woken=True, in_flight=[object(), object()])
    paused = _lane(s, "paused", woken=True, paused_until=20.0)
    leaving = _lane(s, "leaving", woken=True, leaving=True)
    ok = _lane(s, "ok", more_work=True)
    assert s.choose(10.0, True) is ok
    assert s.slot_free(10.0, True) and not s.slot_free(10.0, False)  # ok has a slot, if a session is free
    s.remove(ok)
    assert s.choose(10.0, True) is None and not s.slot_free(10.0, True)
    assert {full.name, paused.name, leaving.name} == {"full", "paused", "leaving"}


def test_a_busy_outbox_claims_less_while_a_quiet_one_is_active() -> None:
    s = _scheduler(batch_size=2000)
    busy = _lane(s, "busy", more_work=True)
    quiet = _lane(s, "quiet")
    assert s.batch_limit(busy, 100.0) == 2000  # the quiet one found no work lately
    quiet.last_work = 99.5  # found work within CONTENDED seconds, no backlog
    # Seen at the next look for quiet outboxes (a scan of every outbox), within QUIET_LOOK.
    assert s.batch_limit(busy, 100.0) == 2000
    assert s.batch_limit(busy, 100.0 + 1.5 * QUIET_LOOK) == FAIR_BATCH
    assert s.batch_limit(quiet, 100.0 + 1.5 * QUIET_LOOK) == 2000  # itself the only quiet one
    quiet.more_work = True  # both have backlogs: full batches
    assert s.batch_limit(busy, 100.0 + 3 * QUIET_LOOK) == 2000


def test_the_look_for_quiet_outboxes_scans_at_most_every_quiet_look() -> None:
    s = _scheduler(batch_size=2000)
    lanes = [_lane(s, f"o{i}", more_work=True) for i in range(1000)]
    looked = 0
    original = s._quiet_but_active

    def counted(now: float) -> list[Any]:
        nonlocal looked
        before = s._quiet_at
        found = original(now)
        looked += s._quiet_at != before
        return found

    s._quiet_but_active = counted  # type: ignore[method-assign]
    for i, lane in enumerate(lanes):  # a claim of each, 1 ms apart
        s.batch_limit(lane, 100.0 + i * 0.001)
    assert looked <= 1.0 / QUIET_LOOK + 1  # one per claim before: 1,000


def test_idle_waits_until_the_next_poll_heartbeat_or_upkeep() -> None:
    s = _scheduler(poll_interval=1.0)
    assert s.idle_wait(0.0, 100.0) == 1.0  # no outbox: the poll interval
    _lane(s, "a", next_poll=3.0)
    assert s.idle_wait(1.0, 100.0) == pytest.approx(2.0)
    assert s.idle_wait(1.0, 1.5) == pytest.approx(0.5)


def test_idle_waits_for_a_limits_next_tokens_and_sees_a_notified_outbox() -> None:
    """The wait reads every lane's poll and retry times, and a limit's next tokens (--limit); a
    NOTIFY since (woken) is seen without a wait."""
    s = _scheduler(poll_interval=1.0, limit=["partner.*=10/s"])
    lanes = [_lane(s, f"o{i}", next_poll=50.0 + i) for i in range(100)]
    lanes[40].retry_at = 20.0
    assert s.idle_wait(10.0, 100.0) == pytest.approx(10.0)
    lanes[7].gates = [Gate(parse_limit("partner.*=10/s"), "^partner", None, next_try=12.5)]
    assert s.idle_wait(10.0, 100.0) == pytest.approx(2.5)
    lanes[7].gates[0].pending = False  # nothing of it waits: its tokens do not wake the loop
    assert s.idle_wait(10.0, 100.0) == pytest.approx(10.0)
    assert not s.woken()
    lanes[99].wake.notified()
    assert s.woken()


def test_quiet_outboxes_are_polled_at_most_so_often_in_all() -> None:
    s = _scheduler(poll_interval=0.5, notify=False)
    for i in range(1000):
        _lane(s, f"o{i}")
    polls = [s.jittered_poll() for _ in range(200)]
    assert min(polls) >= 10.0 and max(polls) <= 30.0  # 1,000 outboxes / 50 polls a second, jittered


def test_with_notify_quiet_outboxes_are_polled_five_times_a_second_in_all() -> None:
    """NOTIFY wakes an outbox at once, and a retry the relay made when it comes due: a poll only
    catches a lost notification, so 1,000 quiet outboxes cost 5 claims a second, not 50."""
    s = _scheduler(poll_interval=0.5, notify=True)
    for i in range(1000):
        _lane(s, f"o{i}")
    polls = [s.jittered_poll() for _ in range(200)]
    assert min(polls) >= 100.0 and max(polls) <= 300.0
    few = _scheduler(poll_interval=0.5, notify=True)
    _lane(few, "only")
    assert max(few.jittered_poll() for _ in range(50)) <= 0.75  # one outbox: its poll interval


def test_a_retry_the_relay_scheduled_makes_its_outbox_due_when_it_comes_due() -> None:
    s = _scheduler(poll_interval=1.0)
    lane = _lane(s, "a", next_poll=500.0)
    lane.wake.woken = lane.more_work = False
    lane.retry_at = 7.0
    assert s.idle_wait(1.0, 100.0) == pytest.approx(6.0)
    assert s.choose(6.9, True) is None
    assert s.choose(7.0, True) is lane


def test_a_slow_batch_halves_the_claims_a_lost_lease_quarters_them_and_fast_ones_double_them_back(
    caplog: pytest.LogCaptureFixture,
) -> None:
    s = _scheduler(batch_size=1000, lease=10.0, delivery_timeout=5.0)
    lane = _lane(s, "a", claim_cap=0)
    with caplog.at_level(logging.WARNING):
        s.pace(lane, cast(Any, _Batch(1000, claimed_at=0.0, outcomes=[Delivered()])), False, 6.0)
        assert lane.pace.cap == 500 and lane.pace.slowed
        s.pace(lane, cast(Any, _Batch(500, claimed_at=0.0)), True, 11.0)
        assert lane.pace.cap == 125
        for _ in range(3):
            s.pace(lane, cast(Any, _Batch(lane.pace.cap, claimed_at=0.0)), False, 0.5)
        assert lane.pace.cap == 0 and not lane.pace.slowed  # back to --batch-size
    assert [r.event for r in caplog.records] == ["claims.pace.slowed", "claims.unpaced"]  # type: ignore[attr-defined]


def test_pacing_never_goes_below_the_minimum_and_ignores_an_outage() -> None:
    s = _scheduler(batch_size=1000, lease=10.0, delivery_timeout=5.0)
    lane = _lane(s, "a", claim_cap=20)
    s.pace(lane, cast(Any, _Batch(20, claimed_at=0.0)), True, 11.0)
    assert lane.pace.cap == MIN_CLAIM
    other = _lane(s, "b", claim_cap=0)
    unreachable = [Retry("timeout", "no answer")]
    s.pace(other, cast(Any, _Batch(1000, claimed_at=0.0, outcomes=unreachable)), False, 9.0)
    assert other.pace.cap == 0  # slowed by an outage, not by the sink's pace
    assert s.start_claim == START_CLAIM


def test_backlogs_are_served_by_weight_and_an_idle_lane_gets_no_credit_for_its_idle_time() -> None:
    s = _scheduler()
    _lane(s, "gold", more_work=True, weight=3)
    _lane(s, "basic", more_work=True)
    chosen = []
    for _ in range(40):
        lane = s.choose(0.0, True)
        assert lane is not None
        chosen.append(lane.name)
        s.served(lane, 500)
    assert chosen.count("gold") == 30 and chosen.count("basic") == 10
    late = _lane(s, "late", more_work=True)  # a backlog that starts now: at the clock, not at 0
    s.served(late, 0)
    picks = []
    for _ in range(8):
        lane = s.choose(0.0, True)
        assert lane is not None
        picks.append(lane.name)
        s.served(lane, 500)
    assert picks.count("late") <= 3, picks


def test_a_fresh_outbox_starts_at_the_relays_pace_not_at_the_slow_start() -> None:
    """The sink is the relay's: once batches of one outbox settle fast at full size, another
    outbox's first claim is a full one (at 1,000 outboxes of 200 events, one claim each, not two)."""
    s = _scheduler(batch_size=2000, lease=30.0, delivery_timeout=5.0)
    first = _lane(s, "first", claim_cap=0)
    first.pace.fresh = True
    assert s.batch_limit(first, 0.0) == START_CLAIM
    cap = START_CLAIM
    while first.pace.cap:
        s.pace(first, cast(Any, _Batch(cap, claimed_at=0.0)), False, 0.1)
        cap = first.pace.cap or 2000
    later = _lane(s, "later", claim_cap=START_CLAIM)
    later.pace.fresh = True
    assert s.batch_limit(later, 1.0) == 2000
    s.pace(later, cast(Any, _Batch(2000, claimed_at=1.0)), True, 40.0)  # it lost its lease: slower
    newest = _lane(s, "newest", claim_cap=START_CLAIM)
    newest.pace.fresh = True
    assert s.batch_limit(newest, 2.0) == 500


def test_companions_are_due_outboxes_with_nothing_in_flight_at_most_a_shared_transactions_worth() -> None:
    s = _scheduler(batch_size=2000)
    most = s.config.shared_outboxes
    lead = _lane(s, "lead", woken=True)
    due = [_lane(s, f"due{i}", more_work=True) for i in range(most + 2)]
    _lane(s, "idle")  # nothing to do
    busy = _lane(s, "busy", woken=True)
    busy.in_flight.append(cast(Any, _Batch(10, 0.0)))  # a batch out: it claims alone
    slowed = _lane(s, "slowed", woken=True)
    slowed.pace.slowed = True  # a slow sink: its batch would hold the others' commit
    solo = _lane(s, "solo", woken=True, solo_until=2e9)  # after a shared transaction failed
    wal = _lane(s, "wal", woken=True, wal=cast(Any, object()))  # commits in the order read
    due[0].claiming = True  # its claim sent ahead, its rows not read yet
    picked = s.companions(lead, now=1.0)
    assert picked == due[1:most]
    assert not {busy, slowed, solo, wal} & set(picked)
    # A companion claims its own limit, within an even share of a --batch-size batch.
    assert s.companion_limit(due[1], 1.0) == 2000 // most
    assert s.companions(busy, 1.0) == [] and s.companions(wal, 1.0) == []  # nor as the lead
    assert _scheduler(shared_claims=False).companions(lead, 1.0) == []


def test_the_claims_sent_ahead_are_the_next_claims_outboxes_if_it_may_share() -> None:
    """ClaimScheduler.ahead: the outbox next_claim chooses and its companions; none when that one
    may not share (a batch out, a limit's claim due), and then the turns are as they were."""
    s = _scheduler(batch_size=2000, shared_outboxes=3)
    lanes = [_lane(s, f"due{i}", more_work=True) for i in range(5)]
    pick = s.ahead(1.0, sessions_free=True)
    assert pick is not None and [pick.lane, *(c for c, _ in pick.companions)] == lanes[:3]
    assert s.ahead(1.0, sessions_free=False) is None
    lanes[4].wake.woken = True  # the next claim's, woken: it has a batch out
    lanes[4].in_flight.append(cast(Any, _Batch(10, 0.0)))
    turn, clock = s.turn, s.clock
    assert s.ahead(1.0, sessions_free=True) is None
    assert (s.turn, s.clock) == (turn, clock)
    assert _scheduler(shared_claims=False).ahead(1.0, sessions_free=True) is None


def test_the_next_claim_says_its_limit_and_companions_and_takes_the_retries_due() -> None:
    """ClaimScheduler.next_claim: the chosen outbox's claim, whole: its limit, the outboxes that
    claim with it and theirs, and what was due of each (a retry) taken, as the claim looks for it;
    a limit's claim with its gate, which takes no retry."""
    s = _scheduler(batch_size=2000, shared_outboxes=3)
    lead = _lane(s, "lead", woken=True, retry_at=0.5)
    other = _lane(s, "other", more_work=True, retry_at=0.9)
    later = _lane(s, "later", more_work=True, retry_at=5.0)  # its retry is not due yet
    pick = s.next_claim(1.0, True)
    assert pick is not None and pick.lane is lead and pick.limit == 2000 and pick.gate is None
    assert pick.companions == [(other, 2000 // 3), (later, 2000 // 3)]
    assert lead.retry_at == other.retry_at == math.inf and later.retry_at == 5.0
    assert s.next_claim(1.0, False) is None
    gated = _scheduler(batch_size=2000)
    limited = _lane(gated, "limited", woken=True, retry_at=0.5)
    limited.gates = gates([parse_limit("orders.*=10/s")])
    pick = gated.next_claim(1.0, True)
    assert pick is not None and pick.gate is limited.gates[0] and pick.companions == []
    assert limited.retry_at == 0.5  # a limit's claim looks for its own events only
