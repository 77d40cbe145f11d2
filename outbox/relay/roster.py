"""The roster: the outboxes a relay serves. They join (a lane each, its ownership looked at, its
NOTIFY channel watched) and leave (their batches finished, their partitions handed over). Their
heartbeats are :mod:`outbox.relay.heartbeats`'."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from functools import partial

from outbox.errors import ConfigError
from outbox.observe.conditions import Condition
from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Beats, Lane, new_lane
from outbox.relay.metrics import RelayMetrics
from outbox.relay.scheduler import ClaimScheduler
from outbox.sinks.base import Sink
from outbox.sinks.chains import KeyChains
from outbox.store.listener import Listener
from outbox.store.membership import Membership
from outbox.store.outboxes import DEFAULT_NAME, Outbox
from outbox.store.schema import channel_name

log = logging.getLogger("outbox.relay")


class Roster:
    """``lanes``: the outboxes served, by name (the relay's, which the health and the heartbeats
    read too); ``outages``: the conditions whose line names the outboxes a database outage stops;
    ``running``: set once the relay produces; ``sink``: the sink of the moment; ``listener``: the
    relay's NOTIFY listener, once started; ``wake``: the loop's wake-up; ``joined``, ``chain`` and
    ``stop_reader``: the upkeep's, as an outbox joins (its capture looked at, its key chains) and
    leaves (its WAL reader stopped)."""

    def __init__(
        self,
        config: RelayConfig,
        membership: Membership,
        scheduler: ClaimScheduler,
        metrics: RelayMetrics,
        lanes: dict[str, Lane],
        beats: Beats,
        chains: dict[str, KeyChains],
        outboxes: list[Outbox],
        *,
        outages: Sequence[Condition],
        running: threading.Event,
        sink: Callable[[], Sink | None],
        listener: Callable[[], Listener | None],
        wake: Callable[[], None],
        joined: Callable[[Lane], None],
        chain: Callable[[Lane], None],
        stop_reader: Callable[[Lane], None],
    ) -> None:
        self.config = config
        self.membership = membership
        self.scheduler = scheduler
        self._joined = joined
        self._chain = chain
        self._stop_reader = stop_reader
        self.metrics = metrics
        self.lanes = lanes
        self.beats = beats  # when each lane's heartbeat is due
        self.chains = chains
        self._outages = outages
        self._running = running
        self._sink = sink
        self._listener = listener
        self._wake = wake
        self._wanted: list[Outbox] | None = outboxes  # the outboxes to serve from the next step
        self._wanted_lock = threading.Lock()

    @property
    def changed(self) -> bool:
        return self._wanted is not None

    def serve(self, outboxes: Sequence[Outbox]) -> None:
        """Serve these from the loop's next step (thread safe)."""
        if len({o.database for o in outboxes} | {lane.outbox.database for lane in self.lanes.values()}) > 1:
            raise ConfigError("a relay serves the outboxes of one database; run one per database")
        with self._wanted_lock:
            self._wanted = list(outboxes)

    def apply(self) -> None:
        """Serve what serve() asked for: new outboxes join, dropped ones start leaving."""
        with self._wanted_lock:
            wanted, self._wanted = self._wanted, None
        if wanted is None:
            return
        names = {o.name for o in wanted}
        for o in wanted:
            lane = self.lanes.get(o.name)
            if lane is not None and lane.outbox == o:
                lane.leaving = False
                continue
            if lane is not None:  # the same name now means another schema: the old one leaves first
                self._leave(lane)
                continue
            self._join(o)
        for lane in list(self.lanes.values()):
            if lane.name not in names:
                self._leave(lane)
        self.forget_left()
        self._name_outage()

    def _name_outage(self) -> None:
        """The database's outage line names the outboxes it stops (but the lone default one)."""
        names = [lane.name for lane in self.scheduler.rotation if not lane.leaving]
        if names == [DEFAULT_NAME] or not names:
            return
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        said = f"outbox {shown}" if len(names) == 1 else f"outboxes {shown}"
        database, stall = self._outages
        database.description = f"{said}: cannot reach PostgreSQL"
        stall.description = f"{said}: the database has not answered"
        for condition in self._outages:
            condition.fields = {"outbox": ",".join(names)}

    def _join(self, o: Outbox) -> None:
        lane = new_lane(
            o, self.config, self.membership, cap=self.scheduler.start_claim, running=self._running.is_set()
        )
        self.lanes[o.name] = lane
        self.scheduler.add(lane)
        self.beats.schedule(lane)
        self._joined(lane)
        if self._sink() is not None:
            self._chain(lane)
        listener = self._listener()
        if listener is not None:
            listener.watch(channel_name(o.schema), partial(self.notified, lane))
        if self._running.is_set():
            log.info("serving outbox %s", o.display, extra={"event": "outbox.joined", "outbox": o.name})

    def _leave(self, lane: Lane) -> None:
        if not lane.leaving:
            lane.leaving = True
            log.info(
                "outbox %s is no longer served",
                lane.name,
                extra={"event": "outbox.left", "outbox": lane.name},
            )

    def forget_left(self) -> None:
        """Lanes that left and have nothing in flight hand their partitions over and go."""
        listener = self._listener()
        for lane in [x for x in self.scheduler.rotation if x.leaving and not x.in_flight and not x.claiming]:
            self._stop_reader(lane)
            lane.ordering.release_all()
            self.scheduler.remove(lane)
            self.beats.forget(lane)
            self.membership.changed = True  # the other relays of its outbox look at it again
            del self.lanes[lane.name]
            self.chains.pop(lane.name, None)
            if listener is not None:
                listener.unwatch(channel_name(lane.schema))
            m = self.metrics  # the gauges of an outbox no longer served go (its counters stay)
            for gauge in (m.pending, m.oldest_age, m.dead_tuples, m.table_bytes, m.oldest_xmin, m.up):
                gauge.forget(0, lane.name)
            m.owned_partitions.forget(0, lane.name)

    def notified(self, lane: Lane) -> None:
        """A NOTIFY for this outbox (the listener's thread): claim it at the next step."""
        lane.wake.notified()
        self._wake()

    def wal_read(self, lane: Lane) -> None:
        """The WAL reader queued a transaction (its thread): send it at the next step. Not a sign
        of rows in the table: marking the table due here made every other WAL batch wait for an
        empty claim of it (decision 0004)."""
        lane.wake.read()
        self._wake()
