"""Many outboxes in one process: a relay per database, one /metrics, the list kept up to date.

``outbox relay --outbox …``, ``--schemas GLOB`` and ``--outboxes-file`` name outboxes in one
or more databases. The database is the unit of failure (down, blackholed, slow) and of
pooling, so each gets a :class:`~outbox.relay.relay.Relay` of its own, running in its own thread
with its own sessions, LISTEN, heartbeat connection and sinks; the outboxes (schemas) of a
database are that relay's lanes. A database that stops answering stops only its relay.

Connections and threads grow with the databases, not with the outboxes: 200 tenant schemas in
one database are one relay thread, at most ``--max-connections`` sessions, one LISTEN and one
heartbeat connection.

The list is read again every ``--discover-every`` seconds when ``--schemas`` finds outboxes
by a glob (a tenant migrated while the relay runs is served; a dropped one is let go), and on
SIGHUP when ``--outboxes-file`` names them. A database that cannot be read at that moment keeps
the outboxes it had: an outage is not a list with fewer tenants.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from outbox.errors import RelayFailed
from outbox.observe.readiness import OUTBOXES_NOT_SERVED, Readiness
from outbox.relay.config import RelayConfig
from outbox.relay.endpoints import HealthServer
from outbox.relay.gauges import DatabaseGauges
from outbox.relay.metrics import RelayMetrics
from outbox.relay.relay import Relay
from outbox.sinks.base import Sink
from outbox.store.outboxes import Outbox

log = logging.getLogger("outbox.fleet")

Database = tuple[tuple[str, str], ...]  # outbox.store.outboxes.database_of


@dataclass
class Found:
    """What a look at the configuration found: the outboxes, and the databases it could not
    read (whose outboxes stay as they were)."""

    outboxes: list[Outbox]
    unreadable: set[Database] = field(default_factory=set)


class Fleet:
    """The relays of one process, one per database. ``find()`` says which outboxes to serve (None:
    the list cannot be read now, nothing changes); it is called at start, every
    ``discover_every`` seconds (None: never again) and on ``reload()`` (SIGHUP)."""

    def __init__(
        self,
        config: RelayConfig,
        sink_factory: Callable[[], Sink],
        find: Callable[[], Found | None],
        *,
        discover_every: float | None = None,
    ) -> None:
        self.config = config
        self._sink_factory = sink_factory
        self._find = find
        self._discover_every = discover_every
        self._stop = threading.Event()
        self._reload = threading.Event()
        self.metrics = RelayMetrics()
        self.transforms = config.transforms  # imported once, for every database's relay
        self.relays: dict[Database, Relay] = {}
        self._threads: dict[Database, threading.Thread] = {}
        self._failures: list[tuple[str, BaseException]] = []
        self._health: HealthServer | None = None
        self.running = threading.Event()

    # -- public -------------------------------------------------------------------

    def stop(self) -> None:
        self._stop.set()
        self._reload.set()

    def reload(self) -> None:
        """Read the list again now (SIGHUP)."""
        self._reload.set()

    @property
    def outboxes(self) -> list[Outbox]:
        return [o for relay in list(self.relays.values()) for o in relay.outboxes]

    def run(self) -> None:
        """Serve until stop(); raises RelayFailed if a relay failed."""
        config = self.config
        if config.metrics_port is not None:
            self._health = HealthServer(
                config.metrics_host, config.metrics_port, self.metrics, self._gauges, self.readiness
            ).start()
            log.info("serving /metrics, /livez, /readyz on %s:%d", config.metrics_host, self._health.port)
        try:
            self._apply(self._find())
            self.running.set()
            next_look = self._next_look()
            while not self._stop.is_set():
                self._reload.wait(max(0.0, next_look - time.monotonic()) if next_look else None)
                if self._stop.is_set() or self._failures:
                    break
                if self._reload.is_set() or (next_look and time.monotonic() >= next_look):
                    self._reload.clear()
                    self._apply(self._find())
                    next_look = self._next_look()
        finally:
            self.running.clear()
            for relay in self.relays.values():
                relay.stop()
            for thread in self._threads.values():
                thread.join(config.grace + 10)
            if self._health is not None:
                self._health.stop()
        if self._failures:
            name, exc = self._failures[0]
            raise RelayFailed(f"the relay of {name} failed: {exc}")

    def readiness(self) -> Readiness:
        """Every relay ready. The head: the one relay's, or how many databases are not ready;
        then the sinks' lines; then one line per outbox (ready, its relay's reason, or its own
        trouble: its schema, its heartbeat, its WAL slot)."""
        relays = list(self.relays.values())
        if not relays:
            return Readiness("starting") if not self.running.is_set() else Readiness("no outbox to serve")
        states = [(relay, relay.readiness()) for relay in relays]
        bad = [relay for relay, r in states if not r.ok]
        sinks: list[str] = []
        lines = []
        for relay, r in states:
            sinks += [line for line in r.sinks if line not in sinks]
            # Not ready for a reason of the whole relay (its database, a sink), or only because
            # some of its outboxes are not served (those say so; the others are ready).
            whole = not r.ok and r.label != OUTBOXES_NOT_SERVED
            for lane in list(relay.lanes.values()):
                trouble = lane.not_served
                if trouble:
                    lines.append(f"outbox {lane.name}: not served: {trouble}")
                else:
                    lines.append(f"outbox {lane.name}: {r.head if whole else 'ready'}")
        if len(relays) == 1:
            one = states[0][1]
            return Readiness(one.label, one.detail, tuple(sinks), tuple(lines))
        if not bad:
            return Readiness("ready", sinks=tuple(sinks), outboxes=tuple(lines))
        return Readiness("not ready", f"{len(bad)} of {len(relays)} databases", tuple(sinks), tuple(lines))

    def ready(self) -> tuple[bool, str]:
        r = self.readiness()
        return r.ok, r.text()

    # -- keeping the relays to the list -----------------------------------------------

    def _next_look(self) -> float:
        return time.monotonic() + self._discover_every if self._discover_every else 0.0

    def _gauges(self) -> list[DatabaseGauges]:
        return [relay.gauges for relay in list(self.relays.values()) if relay.gauges is not None]

    def _apply(self, found: Found | None) -> None:
        if found is None:
            return
        by_database: dict[Database, list[Outbox]] = {}
        for o in found.outboxes:
            by_database.setdefault(o.database, []).append(o)
        for database, relay in list(self.relays.items()):
            if database in found.unreadable:
                continue  # not read this time: it keeps what it serves
            wanted = by_database.pop(database, [])
            if wanted:
                relay.serve(wanted)
            else:
                log.info("no outbox left in %s: its relay stops", relay.outboxes[0].display.split(" ", 1)[1])
                relay.stop()
                self._threads.pop(database).join(self.config.grace + 10)
                del self.relays[database]
        for database, outboxes in by_database.items():
            self._start(database, outboxes)

    def _start(self, database: Database, outboxes: list[Outbox]) -> None:
        relay = Relay(
            self.config, self._sink_factory, outboxes, metrics=self.metrics, transforms=self.transforms
        )
        name = ", ".join(o.name for o in outboxes[:3]) + (
            f" and {len(outboxes) - 3} more" if len(outboxes) > 3 else ""
        )

        def target() -> None:
            try:
                relay.run()
            except Exception as exc:  # logged by the relay; the fleet stops and exits non-zero
                self._failures.append((name, exc))
                self._stop.set()
                self._reload.set()

        thread = threading.Thread(target=target, name=f"outbox-relay-{len(self._threads)}", daemon=True)
        self.relays[database] = relay
        self._threads[database] = thread
        thread.start()

    def stats(self) -> dict[str, Any]:
        """Delivered, retried and dead per outbox (for tests and the bench)."""
        return {
            lane.name: lane.stats
            for relay in list(self.relays.values())
            for lane in list(relay.lanes.values())
        }
