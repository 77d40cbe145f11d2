"""The relay: claim committed events, publish them, record what happened.

A relay serves the outboxes of one database (a schema each; one, the ``--dsn``/``--schema``
outbox, unless told more): each is a :class:`~outbox.relay.lanes.Lane`. :class:`Relay` is the
composition root and the facade: it builds each part with the collaborators it uses, runs the
:class:`~outbox.relay.loop.Loop`, and starts and stops the rest. The parts, in the order an
event meets them:

- :class:`~outbox.relay.claims.ClaimStep`: which outbox claims now (the
  :class:`~outbox.relay.scheduler.ClaimScheduler` says: no SQL, no sink), through which intake;
- the intakes claim and never send: :class:`~outbox.relay.intake.Intake` (an outbox's table, or
  several outboxes' in one transaction), :class:`~outbox.relay.gated.GateIntake` (a limit's),
  :class:`~outbox.relay.wal_intake.WalIntake` (a WAL lane's slot and table, in turns), each
  through :class:`~outbox.relay.claim.TableClaim`;
- :class:`~outbox.relay.dispatch.Dispatcher`: a batch's events to the sink, the batch into the
  :class:`~outbox.relay.ledger.Ledger`;
- :class:`~outbox.relay.finisher.BatchFinisher`: a batch whose every event has an outcome is
  finished on its threads, in WAL order; the loop records it (the
  :class:`~outbox.relay.recorder.BatchRecorder`) and it leaves through the ledger, the one place
  a batch leaves.

Beside them: the :class:`~outbox.relay.roster.Roster` (outboxes join and leave), the
:class:`~outbox.relay.heartbeats.Heartbeats` (the membership heartbeat and the ownership looks),
the :class:`~outbox.relay.upkeep.LaneUpkeep` (capture looks and WAL readers, archive partitions,
sinks replaced and back) and :class:`~outbox.relay.health.RelayHealth` (readiness, the stall
watchdog).

Pipelining: up to ``max_batches_in_flight`` batches of one outbox are out at once, each in
its own transaction on its own connection, so the next batch is produced while the previous
one awaits its acks. Capacity bounds the claim: never more than ``batch_size ×
max_batches_in_flight`` events of an outbox are held, and never more sessions than the
budget (``max_connections``) are open.

Threads: the loop owns the lanes (:mod:`outbox.relay.loop`). The listener's thread (NOTIFY) and
each WAL reader's thread only set a lane's ``woken``/``table_news`` flags and wake the loop; the
finisher's threads run a batch's statements and hand the result back as a future the loop reads,
and wake it; a sink that signals (Kafka's report thread, the asyncio sinks' loops) sets the same
wake-up when reports are ready. The health server's thread reads copies.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import psycopg

from outbox.errors import ConfigError, MissingExtra
from outbox.observe.readiness import OUTBOXES_NOT_SERVED, Readiness
from outbox.relay.claim import TableClaim
from outbox.relay.claims import ClaimStep
from outbox.relay.config import RelayConfig
from outbox.relay.dispatch import Dispatcher
from outbox.relay.endpoints import HealthServer
from outbox.relay.finisher import BatchFinisher
from outbox.relay.gated import GateIntake
from outbox.relay.gauges import DatabaseGauges
from outbox.relay.health import RelayHealth
from outbox.relay.heartbeats import Heartbeats
from outbox.relay.intake import Intake
from outbox.relay.lanes import Beats, Lane, RelayStats
from outbox.relay.ledger import Ledger
from outbox.relay.loop import REPORT_WAIT_FULL, Loop, Wakeup
from outbox.relay.metrics import RelayMetrics
from outbox.relay.ordering import Ordering
from outbox.relay.recorder import BatchRecorder
from outbox.relay.roster import Roster
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.upkeep import ArchivePartitions, CaptureWatch, Chores, LaneUpkeep, SinkUpkeep
from outbox.relay.wal_intake import WalIntake
from outbox.sinks.base import CurrentSink, Sink, wake_of
from outbox.sinks.chains import KeyChains
from outbox.store.dsn import with_net_timeouts
from outbox.store.hygiene import Hygiene
from outbox.store.listener import Listener
from outbox.store.membership import Membership
from outbox.store.outboxes import DEFAULT_NAME, Outbox
from outbox.store.sessions import Link, Sessions
from outbox.transform import Transforms

__all__ = ["OUTBOXES_NOT_SERVED", "Relay", "RelayConfig", "RelayStats"]

log = logging.getLogger("outbox.relay")

NET_PAUSE = 1.0  # seconds to pause after a dropped connection caught by the loop's net
GC_THRESHOLD = 50_000  # allocations between collections of the youngest generation (Python: 700)


def tune_gc() -> None:
    """Set the garbage collector for a process that runs the relay (``outbox relay``, and every
    contender of ``outbox bench``, so that ratios compare like with like): the young generation
    every GC_THRESHOLD allocations, more than a batch in flight allocates, since each collection
    walks every object in flight (docs/decisions/0002-finishing-and-sharing.md has the numbers).
    An application that embeds :class:`Relay` keeps its own setting unless it calls this.
    """
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, older, oldest)


class Relay:
    """One worker over the outboxes of one database: a loop over claimed batches. Call
    ``run()``; ``stop()`` from anywhere; ``serve(outboxes)`` from anywhere to change the
    outboxes served.

    ``outboxes``: the outboxes (schemas) of one database to serve; by default the one of
    ``config.dsn``/``config.schema``, named ``default``. ``metrics``: a registry shared with
    other relays of the process (then the process serves /metrics, not this relay).
    ``transforms``: the functions loaded once for every relay of the process (by default
    ``config.transforms``, loaded here).
    """

    def __init__(
        self,
        config: RelayConfig,
        sink_factory: Callable[[], Sink],
        outboxes: Sequence[Outbox] | None = None,
        *,
        metrics: RelayMetrics | None = None,
        transforms: Transforms | None = None,
    ) -> None:
        self.config = config
        chosen = list(outboxes) if outboxes is not None else [Outbox(DEFAULT_NAME, config.dsn, config.schema)]
        if not chosen:
            raise ConfigError("a relay needs at least one outbox")
        if len({o.database for o in chosen}) > 1:
            raise ConfigError("a relay serves the outboxes of one database; run one per database")
        self.dsn = chosen[0].dsn
        self.sink_factory = sink_factory
        self.current = CurrentSink()  # the sink of the moment, which every part reads
        # --transform: each event of a matching topic goes through its function before routing.
        self.transforms = transforms if transforms is not None else config.transforms
        self.chains: dict[str, KeyChains] = {}  # per outbox, around the sink, where it needs them
        self.stopped = threading.Event()
        self._wakeup = Wakeup()  # the loop's one wait
        # Every connection of the relay notices a dead peer within net_timeout seconds.
        self._dsn = with_net_timeouts(self.dsn, config.net_timeout)
        self.sessions = Sessions(
            self._dsn,
            lease=config.lease,
            stop=self.stopped,
            limit=config.max_connections,
            unreachable=self._unreachable,
        )
        # The outboxes' heartbeats share one connection, outside the sessions' budget.
        self.link = Link(partial(self.sessions.connect, pooled=False))
        # One row in the database's membership: the lease of every partition in every outbox.
        self.membership = Membership(
            self.link, name=config.name, lease=config.ownership_lease, batch_lease=config.lease
        )
        beats = Beats()
        self.scheduler = ClaimScheduler(config, beats)
        lanes: dict[str, Lane] = {}  # the outboxes served, by name (the roster's to change)
        self.listener: Listener | None = None
        self._hygiene: Hygiene | None = None
        self.stats = RelayStats()  # of every outbox served
        self.running = threading.Event()  # set once connected and producing
        self._shared_metrics = metrics is not None
        self._metrics_kept = threading.Event()  # someone reads them: served, or the fleet's (_start)
        self.metrics = metrics if metrics is not None else RelayMetrics()
        self.recorder = BatchRecorder(self.stats, self.metrics, self._metrics_kept.is_set)
        self.health = RelayHealth(
            config, self.sessions, self.membership, lanes, self.running, self.stopped,
            sink=self.current, stopping=lambda: self.stopping, last_claim=lambda: self.recorder.last_claim,
        )  # fmt: skip
        self.ledger = Ledger(self.sessions, self.link, self.membership, self.scheduler)
        self.finisher = BatchFinisher(
            config, self.sessions, self.ledger, self.recorder, lanes=lambda: self.scheduler.rotation,
            sink=self.current, metrics_on=self._metrics_kept.is_set, wake=self.wake,
        )  # fmt: skip
        chores = Chores(self.sessions, self.lane_error)
        self.upkeep = LaneUpkeep(
            CaptureWatch(chores, self.scheduler.rotation, self.wal_read),
            ArchivePartitions(chores, self.scheduler.rotation),
            SinkUpkeep(
                chores,
                self.scheduler,
                self.stats,
                self.metrics,
                sink=self.current,
                make=self.sink_factory,
                use=self.use_sink,
                chains=self.chains,
                await_finishers=self.finisher.await_all,
                settle_unreported=self.finisher.settle_unreported,
            ),
        )
        self.roster = Roster(
            config, self.membership, self.scheduler, self.metrics, lanes, beats, self.chains, chosen,
            outages=(self.sessions.database, self.health.loop_stall), running=self.running,
            sink=self.current, listener=lambda: self.listener, wake=self.wake,
            joined=self.upkeep.capture.joined, chain=self.upkeep.sinks.chain,
            stop_reader=self.upkeep.capture.stop_reader,
        )  # fmt: skip
        self.dispatcher = Dispatcher(
            self.ledger, self.metrics, self.transforms,
            sink=self.current, chains=self.chains, metrics_on=self._metrics_kept.is_set,
        )  # fmt: skip
        send = self.dispatcher.send
        table = TableClaim(self.sessions, send=send, claimed=self.recorder.claim, lane_error=self.lane_error)
        self.intake = Intake(self.sessions, self.scheduler, table, send=send, flush=self.dispatcher.flush)
        self.gated = GateIntake(
            self.sessions, self.link, self.membership, table, self.metrics, send=send,
            metrics_on=self._metrics_kept.is_set,
        )  # fmt: skip
        self.wal_intake = WalIntake(
            self.sessions, self.scheduler, table, send=send, lane_error=self.lane_error
        )
        self.heartbeats = Heartbeats(
            self.membership, self.sessions, lanes, beats, self.metrics,
            sink=self.current, busy=lambda: bool(self.ledger.busy),
            sinks_back=self.upkeep.sinks.sinks_back, label=self.health.label,
            progress=self._progressed, metrics_on=self._metrics_kept.is_set,
        )  # fmt: skip
        self.claims = ClaimStep(
            self.scheduler, self.intake, self.gated, self.wal_intake, free=self.sessions.available
        )
        self.loop = Loop(
            self.sessions, self.scheduler, self.ledger, self.finisher, self.roster, self.heartbeats,
            self.upkeep, self.claims, self._wakeup, sink=self.current, reported=self._sink_reported,
        )  # fmt: skip
        self.http: HealthServer | None = None
        self.gauges: DatabaseGauges | None = None

    # -- public -----------------------------------------------------------------

    @property
    def lanes(self) -> dict[str, Lane]:
        return self.roster.lanes

    @property
    def ordering(self) -> Ordering:
        """The ordering of the relay's first outbox (the only one, unless it serves several)."""
        return next(iter(self.lanes.values())).ordering

    @property
    def outboxes(self) -> list[Outbox]:
        return [lane.outbox for lane in self.lanes.values()]

    def serve(self, outboxes: Sequence[Outbox]) -> None:
        """Serve these outboxes from the loop's next step (thread safe): new ones join, those
        left out finish their batches in flight, hand their partitions over and leave."""
        self.roster.serve(outboxes)
        self._wakeup.set()

    def stop(self) -> None:
        """Ask the loop to stop claiming and shut down gracefully. Thread/signal safe."""
        self.stopped.set()
        self._wakeup.set()

    def _progressed(self) -> None:
        """The loop went on: a claim went through (the stall watchdog's)."""
        self.health.loop_progress = time.monotonic()

    def _sink_reported(self) -> None:
        """A sink reported, or a batch came or went (the stall watchdog's)."""
        self.health.sink_progress = time.monotonic()

    def _unreachable(self) -> None:
        """The database cannot be reached: WAL capture's readers let go (BatchFinisher)."""
        self.finisher.let_go_of_the_wal()

    def wake(self) -> None:
        """Wake the loop (any thread): a lane has news."""
        self._wakeup.set()

    def use_sink(self, sink: Sink) -> None:
        """Deliver through ``sink`` from now on; wait on its wake-up if it signals its reports."""
        self.current.sink = sink
        self._wakeup.use(wake_of(sink))

    def wal_read(self, lane: Lane) -> None:
        """A lane's WAL reader queued a transaction (its thread)."""
        self.roster.wal_read(lane)

    @property
    def stopping(self) -> bool:
        return self.stopped.is_set()

    def run(self) -> None:
        """Relay until ``stop()``; then finish in-flight batches within the grace budget."""
        starting = True
        try:
            self._start()
            starting = False
            self.running.set()
            while not self.stopped.is_set():
                try:
                    self.loop.step()
                except psycopg.OperationalError as exc:
                    # Every database call on the loop handles a lost connection
                    # itself; this is the net under a path that does not. A relay
                    # runs for months: it must not exit on a dropped connection.
                    log.exception(
                        "database connection lost on an unguarded path; releasing in-flight batches"
                    )
                    self.sessions.database.fail(self.sessions.clean(exc))
                    self.intake.give_up_ahead()
                    self.finisher.release_all("connection lost")
                    self.stopped.wait(NET_PAUSE)
        except Exception as exc:
            if not (starting and isinstance(exc, MissingExtra)):  # refused at start: one line, the caller's
                log.exception("relay loop failed; in-flight events stay pending for the next owner")
            raise
        finally:
            self.running.clear()
            self.stopped.set()
            self._shutdown()

    def readiness(self) -> Readiness:
        """Database reachable, every sink up, every outbox served, not shutting down."""
        return self.health.readiness()

    def ready(self) -> tuple[bool, str]:
        """For /readyz: (ready?, why): the first line says why (or ``ready``); then one line per
        sink, and with several outboxes, one line per outbox that is not."""
        r = self.health.readiness()
        return r.ok, r.text()

    def stalled(self) -> str | None:
        """Why the relay is making no progress though nothing reported an error, or None."""
        why = self.health.stalled()
        return f"stalled: {why}" if why else None

    @property
    def metrics_on(self) -> bool:
        return self._metrics_kept.is_set()

    def lane_error(self, lane: Lane, conn: psycopg.Connection[Any], error: str) -> None:
        """An error of this outbox's own on ``conn``: the lane rests, the session goes back."""
        lane.pause(error)
        self.sessions.roll_back(conn)

    # -- start and stop ---------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        if config.metrics_port is not None and not self._shared_metrics:
            self.gauges = DatabaseGauges(self._dsn, lambda: self.outboxes, self.metrics, config.limits)
            self.http = HealthServer(
                config.metrics_host, config.metrics_port, self.metrics, [self.gauges], self.readiness
            ).start()
            log.info("serving /metrics, /livez, /readyz on %s:%d", config.metrics_host, self.http.port)
        elif self._shared_metrics:
            self.gauges = DatabaseGauges(self._dsn, lambda: self.outboxes, self.metrics, config.limits)
        if self.http is not None or self._shared_metrics:
            self._metrics_kept.set()
        if config.notify:
            self.listener = Listener(self._dsn, self.stopped)
        self.chains.clear()
        self.use_sink(self.sink_factory())
        self.roster.apply()
        self.heartbeats.first(self.scheduler.rotation)
        self.upkeep.capture.refuse_wal_without_reader()
        if config.vacuum:
            self._hygiene = Hygiene(
                self._dsn, lambda: [lane.schema for lane in self.scheduler.rotation], self.stopped,
                threshold=config.vacuum_threshold,
            )  # fmt: skip
            self._hygiene.start()
        if self.listener is not None:
            self.listener.start()
        self.health.start_watchdog()
        lanes = list(self.lanes.values())
        shown = f"schema={lanes[0].schema}" if len(lanes) == 1 else f"{len(lanes)} outboxes"
        log.info(
            "relay %s started: %s ordering=%s on-dead=%s batch=%d in-flight batches=%d lease=%ss notify=%s",
            config.name,
            shown,
            config.ordering,
            config.on_dead,
            config.batch_size,
            config.max_batches_in_flight,
            config.lease,
            config.notify,
        )

    def _shutdown(self) -> None:
        """Stop claiming; give in-flight batches the grace budget; release the rest."""
        self.intake.give_up_ahead()  # claims sent ahead: their events stay pending, none was sent
        rotation = self.scheduler.rotation
        deadline = time.monotonic() + self.config.grace
        while any(lane.in_flight for lane in rotation) and self.current.sink is not None:
            if time.monotonic() >= deadline:
                break
            self.current.sink.poll(REPORT_WAIT_FULL)
            self.finisher.finish_complete()
        unfinished = sum(len(lane.in_flight) for lane in rotation)
        if unfinished:
            log.warning(
                "grace budget spent: releasing %d unfinished batches (their events stay pending)", unfinished
            )
            self.finisher.release_all("")
        self.finisher.shutdown()
        sink = self.current.sink
        if sink is not None:
            sink.close(max(0.0, min(1.0, deadline - time.monotonic())))
            self.current.sink = None
        # No batch holds locks any more: hand the partitions over at once.
        for lane in rotation:
            self.upkeep.capture.stop_reader(lane)
            lane.ordering.release_all()
        self.membership.leave()
        self.link.close()
        self.sessions.close_all()
        # (Not started when the relay was refused at start.)
        if self.listener is not None and self.listener.ident is not None:
            self.listener.join(timeout=2.0)
        if self._hygiene is not None and self._hygiene.ident is not None:
            self._hygiene.join(timeout=2.0)
        if self.http is not None:
            self.http.stop()
            self.http = None
            self._metrics_kept.clear()
        log.info(
            "relay stopped: delivered=%d retried=%d dead=%d",
            self.stats.delivered,
            self.stats.retried,
            self.stats.dead,
        )
