"""The relay's heartbeats: its one membership heartbeat (every lease of the relay renewed) and the
looks at each outbox's ownership (registration, hand-overs, acquisitions), a few a loop step, the
most overdue first, spread when the database's relays change."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from outbox.relay.lanes import Beats, Lane
from outbox.relay.metrics import RelayMetrics
from outbox.relay.scheduler import BEAT_EARLY
from outbox.sinks.base import Sink
from outbox.store.membership import Membership
from outbox.store.sessions import Sessions

HEARTBEATS_PER_STEP = 8  # outboxes looked at in one loop step at most (the rest: next step)
# Seconds over which the looks at every outbox spread when the database's relays changed.
LOOK_SPREAD = 0.5


class Heartbeats:
    """``lanes``: the outboxes served (the roster's, read as they change); ``beats``: when each
    one's look is due. ``sink``: the relay's sink now; ``busy``: some batch is in flight;
    ``sinks_back``: the sinks probed while down (SinkUpkeep's); ``label``: the relay's readiness,
    recorded with each heartbeat; ``progress``: the loop went on (RelayHealth's watchdog);
    ``metrics_on``: metrics are kept."""

    def __init__(
        self,
        membership: Membership,
        sessions: Sessions,
        lanes: dict[str, Lane],
        beats: Beats,
        metrics: RelayMetrics,
        *,
        sink: Callable[[], Sink | None],
        busy: Callable[[], bool],
        sinks_back: Callable[[], None],
        label: Callable[[], str],
        progress: Callable[[], None],
        metrics_on: Callable[[], bool],
    ) -> None:
        self.membership = membership
        self.sessions = sessions
        self.lanes = lanes
        self.beats = beats
        self.metrics = metrics
        self._sink = sink
        self._busy = busy
        self._sinks_back = sinks_back
        self._label = label
        self._progress = progress
        self._metrics_on = metrics_on

    def due(self) -> None:
        """The membership heartbeat when due; then the outboxes whose look is due, the most
        overdue first, a few a step: with hundreds of outboxes, claims go on between them."""
        now = time.monotonic()
        member_due = now + BEAT_EARLY >= self.membership.due_at
        due = self.beats.due(now + BEAT_EARLY, HEARTBEATS_PER_STEP)
        if not due and not member_due:
            return
        sink = self._sink()
        if sink is not None and not self._busy():
            # Idle, nothing else reads the sinks' clients: serve their callbacks here, so that a
            # broker that went away is seen (readiness, the outage's log line) before events are due.
            sink.poll(0)
        if member_due:
            self.beat()
            self._sinks_back()
        try:
            for lane in due:
                if not lane.claiming:  # (else at the next step, its claim read: it owns what it claimed)
                    self.look(lane)
        finally:  # left the schedule when taken: back in it at their next (or now, past an error)
            for lane in due:
                self.beats.schedule(lane)

    def beat(self) -> None:
        """The membership heartbeat: every lease of the relay renewed. When the database's relays
        changed, every outbox is looked at within LOOK_SPREAD seconds."""
        sessions = self.sessions
        # The pids are recorded for operators (outbox status, pg_stat_activity), not for fencing.
        conns = [b.conn for lane in self.lanes.values() for b in lane.in_flight]
        pids = sessions.idle_pids() + [
            pid for c in conns if not c.closed and (pid := sessions.pid(c)) is not None
        ]
        member = self.membership
        if member.beat(pids, sessions.stale, self._label()):
            for lane in self.lanes.values():
                lane.ordering.look_within(LOOK_SPREAD)
                self.beats.schedule(lane)
        self.beats.fleet_at = member.due_at
        if not member.heartbeat.active:
            self._progress()

    def look(self, lane: Lane) -> None:
        """A look at one outbox's ownership (its registration, hand-overs, acquisitions)."""
        ordering = lane.ordering
        lost_before = ordering.lost_partitions
        first = ordering.looks == 0
        if ordering.tick(id(b) for b in lane.in_flight):
            lane.wake.notified()  # new partitions: there may be work right now
        if first and ordering.looks:
            self.membership.changed = True  # registered: the other relays of the outbox look again
        if not ordering.heartbeat.active:
            self._progress()
        if self._metrics_on():
            self.metrics.owned_partitions.set(len(ordering.owned), (lane.name,))
            self.metrics.partitions_lost.inc((lane.name,), ordering.lost_partitions - lost_before)

    def first(self, rotation: list[Lane]) -> None:
        """At start: the membership, then a share of every outbox's partitions before the first
        claim; from then on their looks spread over the interval, not all in one step."""
        self.beat()  # the membership first: it is the lease of what the looks take
        for lane in rotation:
            self.look(lane)
        now = time.monotonic()
        for k, lane in enumerate(rotation):
            # A settled outbox's next look is the one its look chose (spread over SETTLED_LOOK); one
            # still short of its share looks again within the interval, spread too. Every outbox
            # looked at again within the interval was 1,000 looks in the middle of the first drain.
            ordering = lane.ordering
            if k and ordering.due_at <= now + ordering.interval:
                ordering.delay_first_heartbeat(random.uniform(0, ordering.interval))
            self.beats.schedule(lane)
