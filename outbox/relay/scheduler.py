"""The claim scheduler: which outbox of a relay claims next, how many events, and how long the
loop may sleep. No SQL and no sink: it reads the lanes' state and the clock.

Fair: the next claim goes to an outbox woken by NOTIFY first (a quiet outbox's latency), then to
the outboxes with a backlog in turn, then to those whose poll timer ran out. A busy outbox has at
most its own slots; the budget's other slots stay for the others.

Paced: a batch that took more than SLOW_BATCH of the lease to settle makes the outbox's next
claims half as large (a quarter after a lost lease), down to MIN_CLAIM; a full batch settled
within FAST_BATCH of it makes them twice as large again, up to --batch-size. An outbox starts at
START_CLAIM events a claim (a slow start).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import time
from dataclasses import dataclass, field
from itertools import islice
from operator import attrgetter

from outbox.relay.batch import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Beats, Lane
from outbox.relay.limits import Gate
from outbox.sinks.base import UNREACHABLE_KINDS, Retry

log = logging.getLogger("outbox.relay")

# Seconds early a heartbeat may go with those due now: a relay's heartbeats are spread over the
# interval, and each one alone woke the loop (500 times a second at 1,000 outboxes); taken a few
# together, the loop wakes about a tenth as often. An interval is seconds: this is noise in it.
BEAT_EARLY = 0.05
FAIR_BATCH = 500  # events per claim, at most, while another outbox of the relay is quiet but active
SLOW_BATCH = 0.5
FAST_BATCH = 0.1
MIN_CLAIM = 10
# An outbox's first claims are of at most START_CLAIM events, doubled by each full batch settled
# fast (a slow start): a sink slower than a --batch-size batch per lease is found on a small
# batch, not by a full one that outlives its lease and is sent again.
START_CLAIM = 100
# Seconds after a retry's due time that its outbox is claimed from (the server's clock set it).
RETRY_MARGIN = 0.05
SOLO_AFTER_ERROR = 60.0  # seconds the outboxes of a shared transaction that failed each claim alone
CONTENDED = 1.0  # seconds since another outbox last found work, for the relay to count as shared
# Seconds between looks for a quiet but active outbox (batch_limit): a quiet one's first event may
# wait this long more behind a full batch of a busy one, where a look per claim scanned every outbox.
QUIET_LOOK = 0.05
IDLE_POLLS = 50.0  # claims a second, at most, that poll quiet outboxes without NOTIFY
# ... and with NOTIFY on: a notification wakes an outbox at once, and a retry the relay scheduled
# when it comes due; polls only catch what a lost notification, or another relay's retry, left.
IDLE_POLLS_NOTIFIED = 5.0

# The lanes' fields an idle relay reads on every wake-up (idle_wait), read at C speed over all of
# them (map/min/any), not by a generator: at a thousand outboxes, each wake-up's cost (decision 0013).
WOKEN = attrgetter("wake.woken")
NEXT_POLL = attrgetter("next_poll")
RETRY_AT = attrgetter("retry_at")
GATES = attrgetter("gates")


@dataclass(slots=True)
class Pick:
    """The scheduler's choice for the next claim: the outbox, its claim's limit, and either the
    limit (``--limit``) whose tokens are due or the outboxes that claim with it in one transaction,
    each with its own limit. What was due of each (a retry) is taken: the claim looks for it."""

    lane: Lane
    limit: int
    gate: Gate | None = None
    companions: list[tuple[Lane, int]] = field(default_factory=list)


class ClaimScheduler:
    """The lanes in turn (``rotation``), and the decisions the loop asks of them."""

    def __init__(self, config: RelayConfig, beats: Beats) -> None:
        self.config = config
        self.beats = beats  # when each lane's heartbeat is due: the loop wakes for them
        self.rotation: list[Lane] = []  # the lanes in turn, for fair claims
        self.turn = 0
        self.sinks_seen_down = -math.inf  # when a heartbeat last found a sink down (monotonic)
        self.clock = 0.0  # the weighted turns' clock: the served count of the last backlog chosen
        # The relay's pace: the claim cap batches of its outboxes last settled fast at (0: full).
        self.proven = START_CLAIM if config.batch_size > START_CLAIM else 0
        self._quiet: list[Lane] = []  # outboxes quiet but active, as last looked for (batch_limit)
        self._quiet_at = -math.inf

    @property
    def start_claim(self) -> int:
        """A new lane's claim cap (0: --batch-size)."""
        return START_CLAIM if self.config.batch_size > START_CLAIM else 0

    def first_cap(self) -> int:
        """The claim cap a lane's first claim starts at: the relay's pace. The sink is the relay's,
        shared by its outboxes: once batches of some outbox settle fast at a size, a thousand
        others need not each start at START_CLAIM (two claims each for 200 events, not one)."""
        return self.proven

    def add(self, lane: Lane) -> None:
        self.rotation.append(lane)

    def remove(self, lane: Lane) -> None:
        self.rotation.remove(lane)
        self.turn = 0

    def slot_free(self, now: float, sessions_free: bool) -> bool:
        """Could some outbox claim now (a session, and a slot of its own), were it due?"""
        per_lane = self.config.max_batches_in_flight
        return sessions_free and any(lane.may_claim(now, per_lane) for lane in self.rotation)

    def next_claim(self, now: float, sessions_free: bool) -> Pick | None:
        """The next claim, or None: its outbox (:meth:`choose`), how many events, and with whom."""
        lane = self.choose(now, sessions_free)
        return None if lane is None else self._pick(lane, now)

    def choose(self, now: float, sessions_free: bool) -> Lane | None:
        """The outbox to claim from next, or None: woken ones first (a quiet outbox's latency),
        then those with a backlog, then those whose poll timer ran out, each kind in turn."""
        if not sessions_free:
            return None
        lanes = self.rotation
        n = len(lanes)
        per_lane = self.config.max_batches_in_flight
        backlog = polled = None
        turn = self.turn % n if n else 0
        for k, lane in enumerate(lanes[turn:] + lanes[:turn]):
            if lane.gates and lane.gate_due(now, per_lane) is not None:  # a limit's tokens are due
                self.turn = (turn + k + 1) % n
                return lane
            # Most lanes of a relay of many have nothing to do: that test first, it is the cheap one
            # (Lane.due, inline: a method call per lane was half the scan at 1,000 outboxes).
            if not (lane.wake.woken or lane.more_work or now >= lane.next_poll or now >= lane.retry_at):
                continue
            if not lane.may_claim(now, per_lane):
                continue
            if lane.wake.woken:
                self.turn = (turn + k + 1) % n
                return lane
            if lane.more_work:
                # Backlogs by weight: the one served least for its weight (--weight).
                if backlog is None or lane.served < backlog[1].served:
                    backlog = (k, lane)
            elif polled is None and (now >= lane.next_poll or now >= lane.retry_at):
                polled = (k, lane)
        chosen = backlog or polled
        if chosen is None:
            return None
        self.turn = (turn + chosen[0] + 1) % n
        if chosen is backlog:
            self.clock = max(self.clock, chosen[1].served)
        return chosen[1]

    def _pick(self, lane: Lane, now: float) -> Pick:
        """``lane``'s claim now: a limit's, if its tokens are due; else its own, with companions."""
        gate = lane.gate_due(now, self.config.max_batches_in_flight) if lane.gates else None
        pick = Pick(lane, self.batch_limit(lane, now), gate)
        if gate is None:
            pick.companions = [(c, self.companion_limit(c, now)) for c in self.companions(lane, now)]
            for each in (lane, *(c for c, _ in pick.companions)):
                if now >= each.retry_at:  # the claim looks for the retry that came due
                    each.retry_at = math.inf
        return pick

    def companions(self, lead: Lane, now: float) -> list[Lane]:
        """Other outboxes that could claim now, to claim with ``lead`` in one transaction (see
        :class:`outbox.relay.batch.Shared`): at most --shared-outboxes - 1, in turn after it. Only outboxes
        with no batch in flight: one whose finish waits (a lock on its archive) or whose sink is
        slow holds up its own batches, not a transaction of others' (its next claims go alone
        while it has one out). Never an outbox read from the WAL (its batches commit in the
        order read), one whose claims a slow sink has made smaller, or one claiming alone after
        an error; nor with the lead being one."""
        most = self.config.shared_outboxes
        if most < 2 or not self.may_share(lead, now):
            return []
        per_lane = self.config.max_batches_in_flight
        lanes = self.rotation
        n = len(lanes)
        turn = self.turn % n if n else 0
        out: list[Lane] = []
        for lane in itertools.chain(lanes[turn:], lanes[:turn]):
            if not (lane.wake.woken or lane.more_work or now >= lane.next_poll or now >= lane.retry_at):
                continue
            if lane is lead or not self.may_share(lane, now) or not lane.may_claim(now, per_lane):
                continue
            if lane.gates and lane.gate_due(now, per_lane) is not None:  # its limit's claim first
                continue
            out.append(lane)
            if len(out) == most - 1:
                break
        return out

    def may_share(self, lane: Lane, now: float) -> bool:
        """May ``lane`` claim in a shared transaction (or ahead of its claim, outbox.pipelined)?
        Its events are in its table (its capture known, no WAL reader), nothing of it is out."""
        return (
            self.config.shared_claims
            and not lane.in_flight
            and lane.wal is None
            and lane.upkept.capture_mode == "table"
            and not lane.pace.slowed
            and now >= lane.solo_until
        )

    def ahead(self, now: float, sessions_free: bool) -> Pick | None:
        """The next claim, to be sent ahead (outbox.pipelined), if its outbox may share and its
        claim is not a limit's. Else None, and the turns are as they were."""
        turn, clock = self.turn, self.clock
        lead = self.choose(now, sessions_free)
        per_lane = self.config.max_batches_in_flight
        if lead is None or not self.may_share(lead, now) or lead.gate_due(now, per_lane) is not None:
            self.turn, self.clock = turn, clock
            return None
        return self._pick(lead, now)

    def companion_limit(self, lane: Lane, now: float) -> int:
        """A companion's claim: its own limit, within an even share of a --batch-size batch."""
        share = self.config.batch_size // self.config.shared_outboxes
        return min(self.batch_limit(lane, now), max(MIN_CLAIM, share))

    def woken(self) -> bool:
        """Has a NOTIFY (or a WAL reader) woken some lane?"""
        return any(map(WOKEN, self.rotation))

    def woken_wait(self, now: float, sessions_free: bool) -> float:
        """Seconds until a woken lane may claim: 0 if one may now, else until the first one's rest
        ends (an error of its own), else never (news wakes the loop: a slot or a session freed)."""
        per_lane = self.config.max_batches_in_flight
        soonest = math.inf
        for lane in self.rotation:
            if not lane.wake.woken:
                continue
            if sessions_free and lane.may_claim(now, per_lane):
                return 0.0
            if lane.paused_until > now and not lane.leaving:
                soonest = min(soonest, lane.paused_until - now)
        return soonest

    def served(self, lane: Lane, events: int) -> None:
        """A claim of ``lane`` took ``events``: its share used, for its weight. A lane that was
        idle starts at the clock (the least served backlog's), not with credit for its idle time."""
        lane.served = max(lane.served, self.clock) + events / lane.weight

    # The lane's claim timing is this module's to write: the other parts say what happened.

    def claimed(self, lane: Lane, limit: int, claimed: int) -> None:
        """``lane``'s claim of at most ``limit`` took ``claimed`` events."""
        self.served(lane, claimed)
        # A full batch means there is probably more: claim again without waiting.
        lane.more_work = claimed == limit or (lane.wal is not None and lane.wal.waiting)
        if not lane.more_work:
            lane.next_poll = time.monotonic() + self.jittered_poll()

    @staticmethod
    def claim_again(lane: Lane) -> None:
        """A claim that came to nothing (not sent, failed, or given up unread): ``lane`` claims
        again at the next step, its events pending as they were."""
        lane.more_work = True

    @staticmethod
    def retry_due_in(lane: Lane, seconds: float) -> None:
        """A retry ``lane``'s batch scheduled comes due in ``seconds``: claim again then, not at
        the next poll (a little after: the server's clock set it)."""
        lane.retry_at = min(lane.retry_at, time.monotonic() + seconds + RETRY_MARGIN)

    @staticmethod
    def alone(lane: Lane, now: float) -> None:
        """A shared transaction of ``lane`` failed: it claims alone a while, where an error is its
        own."""
        lane.solo_until = now + SOLO_AFTER_ERROR

    def idle_wait(self, now: float, maintenance_at: float) -> float:
        """Seconds the loop may sleep: until the next poll, heartbeat, limit's tokens or upkeep
        (NOTIFY wakes it)."""
        lanes = self.rotation
        if not lanes:
            return self.config.poll_interval
        soonest: float = min(min(map(NEXT_POLL, lanes)), min(map(RETRY_AT, lanes)))
        polls = max(0.0, soonest - now)
        if self.config.limit and any(map(GATES, lanes)):  # limits (--limit) give lanes gates
            gates = [g.next_try for lane in lanes for g in lane.gates if g.pending]
            if gates:
                polls = min(polls, max(0.0, min(gates) - now))
        beat = self.beats.next_at()
        beats = max(0.0, beat - BEAT_EARLY - now) if beat is not None else polls
        return min(polls, beats, max(0.0, maintenance_at - now))

    def jittered_poll(self) -> float:
        """Seconds to a quiet lane's next poll. Quiet outboxes are polled in rotation, at most
        IDLE_POLLS (IDLE_POLLS_NOTIFIED with NOTIFY) a second in all (NOTIFY wakes one at once;
        the poll only catches what a lost notification missed). Jitter keeps many relays (and a
        relay's many outboxes) from polling in step."""
        polls = IDLE_POLLS_NOTIFIED if self.config.notify else IDLE_POLLS
        every = max(self.config.poll_interval, len(self.rotation) / polls)
        return every * random.uniform(0.5, 1.5)

    def batch_limit(self, lane: Lane, now: float) -> int:
        """A full batch, unless another outbox of this relay is quiet but active (it found work
        within the last CONTENDED seconds, and no backlog: its last claim was not full): then at
        most FAIR_BATCH, so that the loop's turns stay short and the quiet outbox's event does
        not wait behind this one's long claim, produce and archive (docs/decisions/
        0003-many-outboxes.md has the measurements). Outboxes that all have a backlog keep full
        batches: none of them waits for a single event."""
        if lane.pace.fresh:
            lane.pace.fresh = False
            lane.pace.cap = self.first_cap()
        size = min(self.config.batch_size, lane.pace.cap or self.config.batch_size)
        if size <= FAIR_BATCH or len(self.rotation) < 2:
            return size
        quiet = self._quiet_but_active(now)
        if len(quiet) > 1 or (quiet and quiet[0] is not lane):
            return FAIR_BATCH
        return size

    def _quiet_but_active(self, now: float) -> list[Lane]:
        """Up to two outboxes that found work within CONTENDED seconds and have no backlog, looked
        for at most every QUIET_LOOK seconds: a look is a scan of every outbox, and a claim of each
        of 5,000 outboxes scanning the 5,000 was most of the relay's time in their drain."""
        if now - self._quiet_at >= QUIET_LOOK:
            since = now - CONTENDED
            quiet = (x for x in self.rotation if x.last_work > since and not x.more_work)
            self._quiet = list(islice(quiet, 2))
            self._quiet_at = now
        return self._quiet

    def pace(self, lane: Lane, batch: Batch, lost: bool, now: float) -> None:
        """Claim no more than the sink settles well within the lease.

        The row locks of a batch are its lease: a batch still out when the lease ends loses
        its session, and its events, sent already, are claimed and sent again. A sink that
        takes longer than the lease for a full batch (a webhook at a few requests a second; a
        queue service whose calls slow down; moto's SQS, at 3,000 queued: about 0.5 s a call)
        would then never finish one: every batch sent, none archived, for ever. So a batch
        that took more than SLOW_BATCH of the lease halves the next claims (a lost lease
        quarters them), and full batches settled quickly double them again, up to
        --batch-size. One line when a slow batch first makes claims smaller, one when they are
        back to --batch-size."""
        full = self.config.batch_size
        cap = lane.pace.cap or full
        took = now - batch.claimed_at
        lease = self.config.lease
        # A batch slowed by an outage (the sink was found down while it was out, or some of its
        # sends failed only to reach it) says nothing of the sink's pace once it answers: batches
        # held up by a blackhole, finishing as the sink heals, would cut the claims small just when
        # the backlog has to drain.
        slow = lost or (took > SLOW_BATCH * lease and not self.outage(batch))  # rare: no scan per batch
        if slow:
            new = max(MIN_CLAIM, min(cap, batch.size) // (4 if lost else 2))
        elif took < FAST_BATCH * lease and batch.size >= cap and cap < full:
            new = min(full, cap * 2)
        else:
            return
        lane.pace.cap = 0 if new >= full else new
        if not slow and self.proven and (new >= full or new > self.proven):
            self.proven = 0 if new >= full else new  # the relay's pace: faster
        elif slow and (self.proven == 0 or new < self.proven):
            self.proven = new  # ... or slower
        if slow and not lane.pace.slowed:
            lane.pace.slowed = True
            log.warning(
                "%sa batch of %d events took %.1f s of the %.0f s lease%s: claiming at most %d events "
                "at a time while the sink is this slow",
                lane.said,
                batch.size,
                took,
                lease,
                " and lost it" if lost else "",
                new,
                extra={"event": "claims.pace.slowed", "outbox": lane.name},
            )
        elif new >= full and lane.pace.slowed:
            lane.pace.slowed = False
            log.warning(
                "%sthe sink keeps pace again: claiming up to %d events at a time",
                lane.said,
                full,
                extra={"event": "claims.unpaced", "outbox": lane.name},
            )

    def outage(self, batch: Batch) -> bool:
        """Was the batch out while a heartbeat found a sink down, or did some of its events fail
        only because the sink could not be reached?"""
        if batch.claimed_at <= self.sinks_seen_down:
            return True
        return any(isinstance(o, Retry) and o.kind in UNREACHABLE_KINDS for o in batch.outcomes)
