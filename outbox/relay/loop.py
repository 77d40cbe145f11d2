"""The loop: one thread owns every lane, batch and key hold, and waits in one place.

One step, readable top to bottom::

    serve what the sink reported                          (a sink that signals: poll(0))
    apply changes to the outboxes served                  (discovery, SIGHUP)
    finish the batches whose every event has an outcome   (on a finisher thread; recorded here)
    replace an unhealthy sink
    heartbeat each outbox whose turn it is                (partition leases)
    the upkeep that is due                                (capture looks, partitions, sinks back)
    if a session is free and an outbox may have work:     claim a batch of it, hand it on
    else:                                                 wait for news, or the next deadline

Every other thread (NOTIFY, the WAL readers, the finishers, a sink's report thread, serve and
stop) does its I/O and sets the one :class:`Wakeup`; a sink that signals makes it its own. A sink
that does not signal is polled in slices instead.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from outbox.relay.claims import ClaimStep
from outbox.relay.finisher import BatchFinisher
from outbox.relay.heartbeats import Heartbeats
from outbox.relay.ledger import Ledger
from outbox.relay.roster import Roster
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.upkeep import LaneUpkeep
from outbox.sinks.base import Sink
from outbox.store.sessions import Sessions

REPORT_WAIT = 0.005  # seconds to wait for delivery reports while a claim could start
REPORT_WAIT_FULL = 0.05  # seconds to wait for delivery reports when all slots are busy


class Wakeup:
    """The loop's one wait: NOTIFY, WAL reads, finished batches, serve and stop set it, and so
    does a sink that signals its reports (then it is that sink's own event: :meth:`use`)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signalled = False  # the sink sets the event when reports are ready

    def set(self) -> None:
        """Wake the loop (any thread)."""
        self.event.set()

    def use(self, wake: threading.Event | None) -> None:
        """The sink's wake-up from now on (None: it does not signal, and is polled)."""
        self.signalled = wake is not None
        self.event = wake if wake is not None else threading.Event()
        self.event.set()  # a wake-up set on the one before is not lost: look once more


class Loop:
    """``sink``: the relay's sink now (it is replaced when unhealthy); ``reported``: a sink reported
    (the stall watchdog's stamp)."""

    def __init__(
        self,
        sessions: Sessions,
        scheduler: ClaimScheduler,
        ledger: Ledger,
        finisher: BatchFinisher,
        roster: Roster,
        heartbeats: Heartbeats,
        upkeep: LaneUpkeep,
        claims: ClaimStep,
        wakeup: Wakeup,
        *,
        sink: Callable[[], Sink | None],
        reported: Callable[[], None],
    ) -> None:
        self.sessions = sessions
        self.scheduler = scheduler
        self.ledger = ledger
        self.finisher = finisher
        self.roster = roster
        self.heartbeats = heartbeats
        self.upkeep = upkeep
        self.claims = claims
        self.wakeup = wakeup
        self._sink = sink
        self._reported = reported
        self._empty_until = 0.0  # no claim before this, but after a report (see step)
        self._waiting = 0  # events in flight awaiting a report, at the last step

    def step(self) -> None:
        finisher = self.finisher
        wakeup = self.wakeup
        sink = self._sink()
        signalled = wakeup.signalled and sink is not None
        if signalled:
            wakeup.event.clear()  # first: news that comes while this step looks sets it again
            sink.poll(0)  # type: ignore[union-attr]
        ledger = self.ledger
        waiting, complete = ledger.waiting()
        reported = waiting != self._waiting
        if reported:  # a sink reported (or a batch came or went)
            self._waiting = waiting
            self._reported()
        if self.roster.changed:
            self.roster.apply()
        if finisher.to_finish(complete):
            finisher.finish_complete()
        if sink is None or not sink.healthy():
            self.upkeep.sinks.replace_sink()
            sink = self._sink()
            signalled = wakeup.signalled and sink is not None
        self.heartbeats.due()
        now = time.monotonic()
        self.upkeep.due(now)
        scheduler = self.scheduler
        if self.claims.claim_ahead():  # claims sent during the last step (outbox.pipelined)
            return
        # A claim came back empty behind batches in flight: wait for a report first (once none is
        # in flight, there is none to wait for: its rows' locks and key holds went with it).
        behind = now < self._empty_until and not reported and ledger.busy
        chosen = None if behind else scheduler.next_claim(now, self.sessions.available())
        assert sink is not None
        if chosen is not None:
            claimed = self.claims.claim(chosen, now)
            if claimed == 0 and chosen.lane.in_flight:
                # When every pending key waits behind the batches in flight (after an outage) and
                # writers keep notifying, claims come back empty one after another: the next one
                # waits for a report (or REPORT_WAIT), not for each NOTIFY.
                if signalled:
                    self._empty_until = time.monotonic() + REPORT_WAIT
                else:
                    sink.poll(REPORT_WAIT)
        elif ledger.busy:
            if signalled:
                # Reports, finished batches and NOTIFY all wake the loop; else the next deadline,
                # at most REPORT_WAIT_FULL (the sink's health is looked at each step). One that is
                # due already (a woken lane, a poll) waits for a slot, which only news can free.
                wait = scheduler.idle_wait(now, self.upkeep.next_at())
                wait = min(wait, REPORT_WAIT_FULL) if wait > 0 else REPORT_WAIT_FULL
                if self._empty_until > now:
                    wait = min(wait, self._empty_until - now)
                wakeup.event.wait(wait)
            else:
                # A batch on the finisher frees its slot when the loop next looks: look again soon.
                full = not finisher.finishing and not scheduler.slot_free(now, self.sessions.available())
                sink.poll(REPORT_WAIT_FULL if full else REPORT_WAIT)
        else:
            # Idle: sleep until the next poll, NOTIFY, or the next heartbeat (a long
            # poll interval must not let the ownership leases lapse). An outbox woken that may not
            # claim now (resting after an error of its own) is not a step after step for nothing.
            if not signalled:
                wakeup.event.clear()
            wait = scheduler.idle_wait(now, self.upkeep.next_at())
            if scheduler.woken():  # (a NOTIFY since the choice above: the event may be cleared)
                wait = min(wait, scheduler.woken_wait(now, self.sessions.available()))
            if wait > 0:
                wakeup.event.wait(wait)
