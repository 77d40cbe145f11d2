"""A relay's health: its readiness (:class:`~outbox.observe.readiness.Readiness`), the stall
watchdog, and the progress stamps both read."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from outbox.observe.conditions import Condition
from outbox.observe.readiness import OUTBOXES_NOT_SERVED, Readiness
from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Lane
from outbox.sinks import router
from outbox.sinks.base import Sink
from outbox.store.membership import Membership
from outbox.store.sessions import Sessions

log = logging.getLogger("outbox.relay")

WATCH_EVERY = 1.0  # seconds between the watchdog's looks at the loop's progress
# Seconds between looks at the relay's readiness for the heartbeats to record (its label, shown by
# status and the console). A look reads every lane: once a heartbeat, it kept a relay of 1,000
# idle outboxes busy.
READINESS_EVERY = 1.0


class RelayHealth:
    """Readiness and stall of one relay, and the watchdog behind ``/readyz``: when the loop last
    completed a claim or a heartbeat, and when a sink last reported on a batch."""

    def __init__(
        self,
        config: RelayConfig,
        sessions: Sessions,
        membership: Membership,
        lanes: dict[str, Lane],
        running: threading.Event,
        stopped: threading.Event,
        *,
        sink: Callable[[], Sink | None],
        stopping: Callable[[], bool],
        last_claim: Callable[[], float] | None = None,
    ) -> None:
        """``lanes``: the outboxes served (the roster's); ``running``: set once the relay
        produces; ``stopped``: set when it is to stop; ``sink``: the sink of the moment;
        ``stopping``: whether it is draining to stop; ``last_claim``: when a claim last went
        through (monotonic), progress as a heartbeat is."""
        self.config = config
        self.sessions = sessions
        self.membership = membership
        self.lanes = lanes
        self.running = running
        self.stopped = stopped
        self._sink = sink
        self._stopping = stopping
        self._last_claim = last_claim
        self.loop_progress = time.monotonic()
        self.sink_progress = time.monotonic()
        # A database that stops answering without an error (a blackhole: the bytes are taken, no
        # answer comes) blocks the loop inside a statement: a watchdog thread says so, once.
        self.loop_stall = Condition(log, "stall", "the relay's database has not answered")
        self._watchdog: threading.Thread | None = None
        self._label = "starting"  # the label the heartbeats record, and when it is
        self._label_next = 0.0  # looked at again (monotonic)

    def progressed(self) -> float:
        """When the loop last completed a claim or a heartbeat (monotonic)."""
        claimed = self._last_claim() if self._last_claim is not None else self.loop_progress
        return max(self.loop_progress, claimed)

    def readiness(self) -> Readiness:
        """Database reachable, every sink up, every outbox served, not shutting down."""
        if self._stopping():
            return Readiness("draining", "shutting down")
        if not self.running.is_set():
            return Readiness("starting")
        sink = self._sink()
        if sink is None or not sink.healthy():
            failing = router.states_of(sink)[0] if sink is not None else []
            return Readiness("sink unhealthy", failing[0] if failing else "")
        trouble, states = router.states_of(sink)
        sinks = tuple(states)
        lanes = list(self.lanes.values())  # read from the health server's thread: a copy
        beating = [lane.ordering.heartbeat.active for lane in lanes]
        # The database is unreachable when sessions fail, the membership heartbeat does, or every
        # outbox's look does; one outbox's failing look (its schema dropped) is its trouble only.
        if self.sessions.database.active or self.membership.heartbeat.active or (beating and all(beating)):
            return Readiness("database unreachable", sinks=sinks)
        if trouble:
            return Readiness("sink down", trouble[0], sinks)
        stalled = self.stalled()
        if stalled:
            return Readiness("stalled", stalled, sinks)
        troubled = [(lane.name, why) for lane in lanes if (why := lane.not_served)]
        if troubled:
            lines = tuple(f"outbox {name}: {why}" for name, why in troubled)
            return Readiness(OUTBOXES_NOT_SERVED, f"{len(troubled)} of {len(lanes)}", sinks, lines)
        return Readiness("ready", sinks=sinks)

    def label(self) -> str:
        """The readiness label, looked at once a READINESS_EVERY at most (for the heartbeats)."""
        now = time.monotonic()
        if now >= self._label_next:
            self._label_next = now + READINESS_EVERY
            self._label = self.readiness().label
        return self._label

    def stalled(self) -> str:
        """Why the relay is making no progress though nothing reported an error, or "".

        The loop completes a claim or a heartbeat (every ownership lease / 5) at least every
        few seconds; a statement that hangs on a silent network stops both. With batches in
        flight, a sink reports on one at least every delivery timeout; a silent broker stops
        that, or answers every event with a timeout: no event delivered (or dead-lettered)
        since the first batch that only failed."""
        now = time.monotonic()
        limit = self.config.stall_timeout
        loop_age = now - self.progressed()
        if loop_age > max(limit, 2 * self.config.poll_interval):
            return f"no claim or heartbeat completed for {loop_age:.0f} s"
        lanes = list(self.lanes.values())
        failing = [lane.failing_since for lane in lanes if lane.failing_since]
        if failing and now - min(failing) > limit:
            return f"every delivery attempt failed for {now - min(failing):.0f} s"
        for lane in lanes:
            wal = lane.wal
            if wal is not None and wal.oldest_wait() > limit:
                return (
                    f"{lane.said}the WAL slot does not advance: "
                    f"a transaction read {wal.oldest_wait():.0f} s ago waits"
                )
        flights = [b for lane in lanes for b in list(lane.in_flight)]
        if flights:
            oldest = min(b.claimed_at for b in flights)
            quiet = now - max(self.sink_progress, oldest)
            if quiet > limit:
                return f"{len(flights)} batches in flight, no delivery report for {quiet:.0f} s"
        return ""

    def start_watchdog(self) -> None:
        self._watchdog = threading.Thread(target=self._watch, name="outbox-watchdog", daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        """Every second: has the loop completed a claim or a heartbeat within the stall timeout?
        One line when it has not (the loop is stuck in a statement), one when it has again."""
        limit = max(self.config.stall_timeout, 2 * self.config.poll_interval)
        while not self.stopped.wait(WATCH_EVERY):
            age = time.monotonic() - self.progressed()
            lanes = list(self.lanes.values())
            said = (
                self.sessions.database.active
                or self.membership.heartbeat.active
                or any(lane.ordering.heartbeat.active for lane in lanes)
            )
            if age > limit and not said:  # an error already said it: one problem, one line
                self.loop_stall.fail(f"no claim or heartbeat completed for {age:.0f} s")
            else:
                self.loop_stall.ok()
