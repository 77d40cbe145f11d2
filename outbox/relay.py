"""The relay: claim committed events, publish them, record what happened.

A relay serves the outboxes of one database (a schema each; one, the ``--dsn``/``--schema``
outbox, unless told more): each is a :class:`~outbox.lanes.Lane`. One loop, readable top to
bottom::

    while not stopping:
        apply changes to the outboxes served                  (discovery, SIGHUP)
        finish the batches whose every event has an outcome   (ack/retry/dead + commit, on a
                                                              finisher thread; recorded here)
        heartbeat each outbox whose turn it is                (partition leases)
        if a session is free and an outbox may have work:     claim a batch of it, produce it
                                                              (empty, with batches out: serve reports)
        else:                                                 serve delivery reports, or sleep
                                                              until NOTIFY / the poll timer

Pipelining: up to ``max_batches_in_flight`` batches of one outbox are out at once, each in
its own transaction on its own connection, so the next batch is produced while the previous
one awaits its acks. Capacity bounds the claim: never more than ``batch_size ×
max_batches_in_flight`` events of an outbox are held, and never more sessions than the
budget (``max_connections``) are open.

Fair: the next claim goes to an outbox woken by NOTIFY first (a quiet outbox's latency), then
to the outboxes with a backlog in turn, then to those whose poll timer ran out. A busy outbox
has at most its own slots; the budget's other slots stay for the others.

A batch leaves the loop in one place (:meth:`Relay._done`), which gives its
connection back and drops its key holds; what it did is recorded in one place
(:meth:`Relay._record`): spans, metrics, counters and logs.
"""

from __future__ import annotations

import gc
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import psycopg

from outbox import capture, tracing
from outbox.batch import Batch, BatchResult, WalBatch
from outbox.capture import WalReader
from outbox.conditions import Condition
from outbox.config import RelayConfig
from outbox.dsn import with_net_timeouts
from outbox.errors import ConfigError, FencingError
from outbox.hygiene import Hygiene
from outbox.lanes import Beats, Lane, RelayStats
from outbox.listener import Listener
from outbox.metrics import DatabaseGauges, HealthServer, RelayMetrics
from outbox.ordering import Ordering
from outbox.outboxes import DEFAULT_NAME, Outbox
from outbox.queries import query
from outbox.schema import channel_name
from outbox.sessions import Link, Sessions
from outbox.sinks import router
from outbox.sinks.base import SINK_REPLACED, UNREACHABLE_KINDS, Retry, Sink, send_now
from outbox.sinks.chains import KeyChains

__all__ = ["OUTBOXES_NOT_SERVED", "Relay", "RelayConfig", "RelayStats"]

log = logging.getLogger("outbox.relay")

PARTITION_MAINTENANCE = 3600.0  # seconds between archive partition checks
T = TypeVar("T")

MAINTENANCE_RETRY = 10.0  # seconds before trying again after it failed
CAPTURE_CHECK = 30.0  # seconds between looks at an outbox's capture mode (a slot to read?)
REPORT_WAIT = 0.005  # seconds to wait for delivery reports while a claim could start
REPORT_WAIT_FULL = 0.05  # seconds to wait for delivery reports when all slots are busy
NET_PAUSE = 1.0  # seconds to pause after a dropped connection caught by the loop's net
HEARTBEATS_PER_STEP = 8  # outboxes heartbeating in one loop step at most (the rest: next step)
# Seconds early a heartbeat may go with those due now: a relay's heartbeats are spread over the
# interval, and each one alone woke the loop (500 times a second at 1,000 outboxes); taken a few
# together, the loop wakes about a tenth as often. An interval is seconds: this is noise in it.
BEAT_EARLY = 0.05
# Seconds between looks at the relay's readiness for the heartbeats to record (its kind, shown by
# status and the console). A look reads every lane: once a heartbeat, it kept a relay of 1,000
# idle outboxes busy.
READINESS_EVERY = 1.0
WATCH_EVERY = 1.0  # seconds between the watchdog's looks at the loop's progress
OUTBOXES_NOT_SERVED = "outboxes not served"  # /readyz: the relay is fine, some of its outboxes are not
FAIR_BATCH = 500  # events per claim, at most, while another outbox of the relay is quiet but active
# Pacing a slow sink (Relay._pace): a batch that took more than SLOW_BATCH of the lease to settle
# makes the next claims half as large (a quarter after a lost lease), down to MIN_CLAIM; a full
# batch settled within FAST_BATCH of it makes them twice as large again, up to --batch-size.
SLOW_BATCH = 0.5
FAST_BATCH = 0.1
MIN_CLAIM = 10
# An outbox's first claims are of at most START_CLAIM events, doubled by each full batch settled
# fast (a slow start): a sink slower than a --batch-size batch per lease is found on a small
# batch, not by a full one that outlives its lease and is sent again.
START_CLAIM = 100
CONTENDED = 1.0  # seconds since another outbox last found work, for the relay to count as shared
IDLE_POLLS = 50.0  # claims a second, at most, that poll quiet outboxes without a NOTIFY


GC_THRESHOLD = 50_000  # allocations between collections of the youngest generation (Python: 700)


def _wal_failing(lane: Lane) -> bool:
    """Is the outbox's WAL slot failing to be read (gone, no REPLICATION, the server refusing)?"""
    return lane.wal is not None and lane.wal.condition.active


def _wal_error(lane: Lane) -> str:
    return f"reading its WAL slot: {lane.wal.condition.last_error}" if lane.wal is not None else ""


def tune_gc() -> None:
    """Set the garbage collector for a process that runs the relay (``outbox relay``, and every
    contender of ``outbox bench``, so that ratios compare like with like).

    A relay keeps thousands of events in flight (two batches of 2,000 by default), each
    with its headers, callbacks and the client's futures. With Python's default threshold
    the young generation is collected every 700 allocations, and every collection walks
    the in-flight objects that survived the previous ones: with an asyncio client that
    was a third of the relay's CPU (measured: RabbitMQ 4,500 -> 5,800 events/s, webhooks
    2,400 -> 5,800). Every claimed batch allocates about ten tracked objects per event
    (its event, headers, callbacks and outcomes) that all live until the batch is
    acknowledged, so a threshold below a batch's worth still collects once or twice per
    batch: at 10,000 a Kafka drain of 300,000 events ran 300 collections, 0.6 s of CPU,
    a seventh of the relay's. At 50,000 it runs two. Cyclic garbage waits a little longer
    for collection (a few MB at most). An application that embeds :class:`Relay` keeps its
    own setting unless it calls this.
    """
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_THRESHOLD, older, oldest)


class _NotHandedOn(Exception):
    """A WAL batch's finisher gave up: the batch read before it did not commit."""


class Relay:
    """One worker over the outboxes of one database: a loop over claimed batches. Call
    ``run()``; ``stop()`` from anywhere; ``serve(outboxes)`` from anywhere to change the
    outboxes served.

    ``outboxes``: the outboxes (schemas) of one database to serve; by default the one of
    ``config.dsn``/``config.schema``, named ``default``. ``metrics``: a registry shared with
    other relays of the process (then the process serves /metrics, not this relay).
    """

    def __init__(
        self,
        config: RelayConfig,
        sink_factory: Callable[[], Sink],
        outboxes: Sequence[Outbox] | None = None,
        *,
        metrics: RelayMetrics | None = None,
    ) -> None:
        self.config = config
        chosen = list(outboxes) if outboxes is not None else [Outbox(DEFAULT_NAME, config.dsn, config.schema)]
        if not chosen:
            raise ConfigError("a relay needs at least one outbox")
        if len({o.database for o in chosen}) > 1:
            raise ConfigError("a relay serves the outboxes of one database; run one per database")
        self.dsn = chosen[0].dsn
        self._sink_factory = sink_factory
        self._sink: Sink | None = None
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        # Every connection of the relay notices a dead peer within net_timeout seconds.
        self._dsn = with_net_timeouts(self.dsn, config.net_timeout)
        self.sessions = Sessions(
            self._dsn,
            lease=config.lease,
            stop=self._stop,
            limit=config.max_connections,
            unreachable=self._let_go_of_the_wal,
        )
        # The outboxes' heartbeats share one connection, outside the sessions' budget.
        self._link = Link(partial(self.sessions.connect, pooled=False))
        self.lanes: dict[str, Lane] = {}
        self._rotation: list[Lane] = []  # the lanes in turn, for fair claims
        self._turn = 0
        self._beats = Beats()  # when each lane's heartbeat is due
        # The lanes with batches in flight, in the order they became so: what the loop's every
        # step looks at, where looking at every lane cost a relay of many quiet outboxes.
        self._busy: dict[Lane, None] = {}
        # Batches being finished (their statements and commit) by the finishers, with the time
        # each was handed over; the loop records each once its future is done. A finisher per
        # session of the budget (each batch has a session of its own): one outbox's finish that
        # waits (a lock on its archive) holds up no other outbox's.
        self._finisher = ThreadPoolExecutor(config.max_connections, thread_name_prefix="outbox-finish")
        self._finishing: dict[Batch, tuple[Future[BatchResult], int]] = {}
        self._readiness = "starting"  # the readiness kind the heartbeats record, and when it is
        self._readiness_next = 0.0  # looked at again (monotonic)
        self._wanted: list[Outbox] | None = chosen  # the outboxes to serve from the next step
        self._wanted_lock = threading.Lock()
        self._next_maintenance_check = 0.0
        self._next_capture_check = 0.0
        self._chains: dict[str, KeyChains] = {}  # per outbox, around the sink, where it needs them
        self._sinks_seen_down = -math.inf  # when a heartbeat last found a sink down (monotonic)
        self._listener: Listener | None = None
        self._hygiene: Hygiene | None = None
        self.stats = RelayStats()  # of every outbox served
        self.running = threading.Event()  # set once connected and producing
        self._shared_metrics = metrics is not None
        self.metrics = metrics if metrics is not None else RelayMetrics()
        self._health: HealthServer | None = None
        self.gauges: DatabaseGauges | None = None
        # The watchdog behind /readyz: when the loop last completed a claim or a heartbeat,
        # and when a sink last reported on a batch (monotonic seconds).
        self._loop_progress = time.monotonic()
        self._sink_progress = time.monotonic()
        self._waiting = 0  # events in flight awaiting a report, at the last loop step
        # A database that stops answering without an error (a blackhole: the bytes are taken, no
        # answer comes) blocks the loop inside a statement: a watchdog thread says so, once.
        self.loop_stall = Condition(log, "stall", "the relay's database has not answered")
        self._watchdog: threading.Thread | None = None

    # -- public -----------------------------------------------------------------

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
        if len({o.database for o in outboxes} | {o.database for o in self.outboxes}) > 1:
            raise ConfigError("a relay serves the outboxes of one database; run one per database")
        with self._wanted_lock:
            self._wanted = list(outboxes)
        self._wakeup.set()

    def stop(self) -> None:
        """Ask the loop to stop claiming and shut down gracefully. Thread/signal safe."""
        self._stop.set()
        self._wakeup.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def run(self) -> None:
        """Relay until ``stop()``; then finish in-flight batches within the grace budget."""
        try:
            self._start()
            self.running.set()
            while not self._stop.is_set():
                try:
                    self._step()
                except psycopg.OperationalError as exc:
                    # Every database call on the loop handles a lost connection
                    # itself; this is the net under a path that does not. A relay
                    # runs for months: it must not exit on a dropped connection.
                    log.exception(
                        "database connection lost on an unguarded path; releasing in-flight batches"
                    )
                    self.sessions.database.fail(self.sessions.clean(exc))
                    self._release_in_flight("connection lost")
                    self._stop.wait(NET_PAUSE)
        except Exception:
            log.exception("relay loop failed; in-flight events stay pending for the next owner")
            raise
        finally:
            self.running.clear()
            self._stop.set()
            self._shutdown()

    def ready(self) -> tuple[bool, str]:
        """For /readyz: database reachable, every sink up, every outbox served, not shutting down.

        The first line says why (or ``ready``); then one line per sink, and with several
        outboxes, one line per outbox that is not."""
        if self._stop.is_set():
            return False, "draining: shutting down"
        if not self.running.is_set():
            return False, "starting"
        sink = self._sink
        if sink is None or not sink.healthy():
            return False, "sink unhealthy"
        trouble, states = router.states_of(sink)
        detail = "".join(f"\n{line}" for line in states)
        lanes = list(self.lanes.values())  # read from the health server's thread: a copy
        beating = [lane.ordering.heartbeat.active for lane in lanes]
        # The database is unreachable when sessions fail, or when every outbox's heartbeat does; one
        # outbox's failing heartbeat (its schema dropped) is that outbox's trouble only.
        if self.sessions.database.active or (beating and all(beating)):
            return False, "database unreachable" + detail
        if trouble:
            return False, f"sink down: {trouble[0]}" + detail
        stalled = self.stalled()
        if stalled:
            return False, stalled + detail
        troubled = [
            lane
            for lane in lanes
            if lane.trouble.active or lane.ordering.heartbeat.active or _wal_failing(lane)
        ]
        if troubled:
            lines = "".join(
                f"\noutbox {lane.name}: "
                f"{lane.trouble.last_error or lane.ordering.heartbeat.last_error or _wal_error(lane)}"
                for lane in troubled
            )
            return False, f"{OUTBOXES_NOT_SERVED}: {len(troubled)} of {len(lanes)}" + detail + lines
        return True, "ready" + detail

    def stalled(self) -> str | None:
        """Why the relay is making no progress though nothing reported an error, or None.

        The loop completes a claim or a heartbeat (every ownership lease / 5) at least every
        few seconds; a statement that hangs on a silent network stops both. With batches in
        flight, a sink reports on one at least every delivery timeout; a silent broker stops
        that, or answers every event with a timeout: no event delivered (or dead-lettered)
        since the first batch that only failed."""
        now = time.monotonic()
        limit = self.config.stall_timeout
        loop_age = now - self._loop_progress
        if loop_age > max(limit, 2 * self.config.poll_interval):
            return f"stalled: no claim or heartbeat completed for {loop_age:.0f} s"
        lanes = list(self.lanes.values())
        failing = [lane.failing_since for lane in lanes if lane.failing_since]
        if failing and now - min(failing) > limit:
            return f"stalled: every delivery attempt failed for {now - min(failing):.0f} s"
        for lane in lanes:
            wal = lane.wal
            if wal is not None and wal.oldest_wait() > limit:
                return (
                    f"stalled: {lane.said}the WAL slot does not advance: "
                    f"a transaction read {wal.oldest_wait():.0f} s ago waits"
                )
        flights = [b for lane in lanes for b in list(lane.in_flight)]
        if flights:
            oldest = min(b.claimed_at for b in flights)
            quiet = now - max(self._sink_progress, oldest)
            if quiet > limit:
                return f"stalled: {len(flights)} batches in flight, no delivery report for {quiet:.0f} s"
        return None

    # -- the loop ---------------------------------------------------------------

    def _step(self) -> None:
        waiting = sum(b.waiting for lane in self._busy for b in lane.in_flight)
        if waiting != self._waiting:  # a sink reported (or a batch came or went)
            self._waiting = waiting
            self._sink_progress = time.monotonic()
        if self._wanted is not None:
            self._apply_outboxes()
        self._finish_complete_batches()
        if self._sink is None or not self._sink.healthy():
            self._replace_sink()
        # The most overdue first, a few a step: with hundreds of outboxes, claims go on between them.
        due = self._beats.due(time.monotonic() + BEAT_EARLY, HEARTBEATS_PER_STEP)
        if due:
            if self._sink is not None and not self._busy:
                # Idle, nothing else reads the sinks' clients: serve their callbacks here, so that a
                # broker that went away is seen (readiness, the outage's log line) before events are due.
                self._sink.poll(0)
            readiness = self._readiness_kind()
            try:
                for lane in due:
                    self._heartbeat(lane, readiness)
            finally:  # left the schedule when taken: back in it at their next (or now, past an error)
                for lane in due:
                    self._beats.schedule(lane)
            self._sinks_back(due)
        now = time.monotonic()
        if now >= self._next_maintenance_check:
            self._maintain_partitions(now)
        if now >= self._next_capture_check:
            self._check_capture(now)
        chosen = self._next_claim(now)
        if chosen is not None:
            if chosen.table_news:  # WAL capture: rows were inserted into its events table
                chosen.table_news = False
                chosen.table_due = True
            chosen.woken = False  # a NOTIFY arriving during the claim sets it again
            limit = self._batch_limit(chosen, now)
            claimed = self._claim_and_send(chosen, limit)
            # A full batch means there is probably more: claim again without waiting.
            chosen.more_work = claimed == limit or (chosen.wal is not None and chosen.wal.waiting)
            if not chosen.more_work:
                chosen.next_poll = time.monotonic() + self._jittered_poll()
            if claimed == 0 and chosen.in_flight:
                # Serve the reports of the batches in flight before the next claim: when every
                # pending key waits behind them (after an outage) and writers keep notifying,
                # claims come back empty one after another, and without this the loop would
                # never read the reports that finish those batches (until their lease ran out).
                assert self._sink is not None
                self._sink.poll(REPORT_WAIT)
        elif self._busy:
            assert self._sink is not None
            # A batch on the finisher frees its slot when the loop next looks: look again soon.
            full = not self._finishing and not self._slot_free(now)
            self._sink.poll(REPORT_WAIT_FULL if full else REPORT_WAIT)
        else:
            # Idle: sleep until the next poll, NOTIFY, or the next heartbeat (a long
            # poll interval must not let the ownership leases lapse).
            self._wakeup.clear()
            if not any(lane.woken for lane in self._rotation):
                self._wakeup.wait(self._idle_wait(now))

    def _readiness_kind(self) -> str:
        """The kind of the relay's /readyz state (never its detail), looked at once a
        READINESS_EVERY at most."""
        now = time.monotonic()
        if now >= self._readiness_next:
            self._readiness_next = now + READINESS_EVERY
            self._readiness = self.ready()[1].split("\n", 1)[0].split(":", 1)[0]
        return self._readiness

    def _slot_free(self, now: float) -> bool:
        """Could some outbox claim now (a session, and a slot of its own), were it due?"""
        per_lane = self.config.max_batches_in_flight
        return self.sessions.available() and any(lane.may_claim(now, per_lane) for lane in self._rotation)

    def _next_claim(self, now: float) -> Lane | None:
        """The outbox to claim from next, or None: woken ones first (a quiet outbox's latency),
        then those with a backlog, then those whose poll timer ran out, each kind in turn."""
        if not self.sessions.available():
            return None
        lanes = self._rotation
        n = len(lanes)
        per_lane = self.config.max_batches_in_flight
        backlog = polled = None
        turn = self._turn % n if n else 0
        for k, lane in enumerate(lanes[turn:] + lanes[:turn]):
            # Most lanes of a relay of many have nothing to do: that test first, it is the cheap one.
            if not lane.due(now) or not lane.may_claim(now, per_lane):
                continue
            if lane.woken:
                self._turn = (turn + k + 1) % n
                return lane
            if backlog is None and lane.more_work:
                backlog = (k, lane)
            elif polled is None and now >= lane.next_poll:
                polled = (k, lane)
        chosen = backlog or polled
        if chosen is None:
            return None
        self._turn = (turn + chosen[0] + 1) % n
        return chosen[1]

    def _idle_wait(self, now: float) -> float:
        lanes = self._rotation
        if not lanes:
            return self.config.poll_interval
        polls = min(max(0.0, lane.next_poll - now) for lane in lanes)
        beat = self._beats.next_at()
        beats = max(0.0, beat - BEAT_EARLY - now) if beat is not None else polls
        return min(polls, beats, max(0.0, self._next_maintenance_check - now))

    def _jittered_poll(self) -> float:
        # Quiet outboxes are polled in rotation, at most IDLE_POLLS a second in all (NOTIFY wakes
        # one at once; the poll only catches what a lost notification missed). Jitter keeps
        # many relays (and a relay's many outboxes) from polling in step.
        every = max(self.config.poll_interval, len(self._rotation) / IDLE_POLLS)
        return every * random.uniform(0.5, 1.5)

    def _batch_limit(self, lane: Lane, now: float) -> int:
        """A full batch, unless another outbox of this relay is quiet but active (it found work
        within the last CONTENDED seconds, and no backlog: its last claim was not full): then at
        most FAIR_BATCH, so that the loop's turns stay short and the quiet outbox's event does
        not wait behind this one's long claim, produce and archive. Measured (bench tenants, a
        quiet outbox at 10 events/s beside a 1M backlog, commit -> ack): p99 135 ms, max 910 ms
        behind 1,000-event claims; p99 58 ms, max 88-123 ms behind 500, the busy drain 13.0k vs
        14.2k events/s. Outboxes that all have a backlog keep full batches: none of them waits
        for a single event."""
        size = min(self.config.batch_size, lane.claim_cap or self.config.batch_size)
        if size <= FAIR_BATCH or len(self._rotation) < 2:
            return size
        since = now - CONTENDED
        for other in self._rotation:
            if other is not lane and other.last_work > since and not other.more_work:
                return FAIR_BATCH
        return size

    def _claim_and_send(self, lane: Lane, limit: int) -> int:
        assert self._sink is not None
        if not lane.next_capture:  # its capture mode first: a slot to read before the table?
            self._check_lane_capture(lane, time.monotonic())
        wal = lane.wal
        if wal is not None:
            # WAL capture: the slot's transactions and the table's events (retries, delayed, held
            # behind a failure) take turns while the table has work: a NOTIFY since its last
            # claim (every insert into events sends one), a full last claim, or its poll timer.
            # An empty claim every other batch was a round trip per WAL batch for nothing
            # (8 % of the loop's time in a drain). WAL batches go out pipelined like claimed
            # ones, and finish in the order they were read (_finish_complete_batches).
            lane.table_turn = not lane.table_turn
            table_due = lane.table_due or time.monotonic() >= lane.next_table_claim
            if wal.waiting and not (lane.table_turn and table_due):
                return self._read_and_send(lane, limit)
            if lane.capture_mode == "table" and not (wal.reading and wal.caught_up):
                # Switched back to table capture with the slot kept: the events still in the slot
                # were committed before the rows written since, so the table waits until this
                # relay has read the slot up to what the server has (a relay that stands by
                # claims nothing of this outbox until the slot is dropped).
                return 0
        conn = self.sessions.take()
        if conn is None:
            return 0
        claim_start = time.time_ns()
        try:
            rows = lane.ordering.claim(conn, limit)
            if not rows:
                conn.rollback()
        except psycopg.OperationalError as exc:
            # Connection gone, server restarting, session ended (also between an
            # empty claim and its rollback): nothing was claimed that will not be
            # claimed again.
            self.sessions.lost(conn, f"claim failed: {self.sessions.clean(exc)}")
            return 0
        except psycopg.Error as exc:
            # The database answers, but not for this outbox (its schema dropped, not migrated,
            # a privilege taken away): this outbox rests, the others go on.
            self._lane_error(lane, conn, f"claim failed: {self.sessions.clean(exc)}")
            return 0
        self.sessions.database.ok()  # the claim went through, empty or not
        lane.trouble.ok()
        if wal is not None:
            lane.table_due = len(rows) >= limit
            lane.next_table_claim = time.monotonic() + self._jittered_poll()
        self._loop_progress = time.monotonic()
        self.stats.claims += 1
        lane.stats.claims += 1
        if not rows:
            self.sessions.give_back(conn)
            return 0
        lane.last_work = time.monotonic()
        ordering = lane.ordering
        batch = Batch(conn, rows, holds=ordering.holds if ordering.ordered else None, parks=ordering.parks)
        return self._send(lane, batch, claim_start, limit)

    def _read_and_send(self, lane: Lane, limit: int) -> int:
        """WAL capture: send the next committed transactions read from the outbox's slot. The
        events of a key that has events waiting in the table (or a parked dead letter) are held,
        and go into the table behind them when the batch finishes."""
        assert lane.wal is not None
        conn = self.sessions.take()
        if conn is None:
            return 0
        claim_start = time.time_ns()
        taken = lane.wal.take(limit)
        if taken is None:
            self.sessions.give_back(conn)
            return 0
        rows, after = taken
        ordering = lane.ordering
        batch = WalBatch(
            conn, rows, after, holds=ordering.holds if ordering.ordered else None, parks=ordering.parks
        )
        keys = list({e.key for e in batch.events if e is not None and e.key is not None})
        try:
            found: list[tuple[Any, ...]] = []
            if keys:
                found = conn.execute(query("wal_keys_waiting", lane.schema), {"keys": keys}).fetchall()
            waiting: dict[bytes, float] = {row[0]: row[1] for row in found}
        except psycopg.Error as exc:
            lane.wal.rewind()  # read again from the slot
            if isinstance(exc, psycopg.OperationalError):
                self.sessions.lost(conn, f"WAL batch failed: {self.sessions.clean(exc)}")
            else:
                self._lane_error(lane, conn, f"WAL batch failed: {self.sessions.clean(exc)}")
            return 0
        for i, event in enumerate(batch.events):
            # Held (into the table, behind them) when the key has older events waiting there.
            if (
                event is not None
                and event.key is not None
                and waiting.get(event.key, math.inf) <= event.created_at
            ):
                batch.hold(i)
        self._loop_progress = lane.last_work = time.monotonic()
        self.stats.claims += 1
        lane.stats.claims += 1
        return self._send(lane, batch, claim_start, limit)

    def _send(self, lane: Lane, batch: Batch, claim_start: int, limit: int) -> int:
        """Hand a batch's events to the sink (their outcomes come back through ``batch.settle``)."""
        assert self._sink is not None
        ordering = lane.ordering
        sink = self._sink
        batch.spans = tracing.start_batch(
            batch.events, claim_start, time.time_ns(), partial(self._span_shape, sink, lane.name)
        )
        self.stats.claimed += len(batch)
        lane.stats.claimed += len(batch)
        if self._metrics_on:
            self.metrics.batch_size.observe(len(batch), (lane.name,))
        # Per-key order: once an event of key K fails (in this batch or in one
        # still in flight), K's later events are held: left pending, untouched.
        # When the failure is committed, the claim query blocks them instead.
        held = ordering.holds.keys if ordering.ordered else None
        events = batch.events
        start = 0
        chains = self._chains.get(lane.name)
        # A lane with key chains goes through them, event by event: never around them.
        produce_many = None if chains is not None else getattr(sink, "produce_many", None)
        if produce_many is not None and not held and batch.waiting == len(batch):
            # Nothing held, nothing corrupt: the batch goes to the sink in one call
            # (KafkaSink.produce_many), up to the first event the sink does not take as it is.
            start = produce_many(events, batch.outcomes, batch.settle)
        produce = chains.produce if chains is not None else sink.produce
        for i in range(start, len(events)):
            event = events[i]
            if event is None or batch.outcomes[i] is not None:  # corrupt (dead), or held before
                continue
            if held and event.key is not None and event.key in held:
                batch.hold(i)
                continue
            outcome = produce(event, partial(batch.settle, i))
            if outcome is not None:
                batch.settle(i, outcome)
        lane.in_flight.append(batch)
        self._busy[lane] = None
        # (WAL capture: a batch cut short by a transaction's end is no sign of an idle outbox
        # while the reader holds a full batch more. Anything waiting was too broad: at 1,000
        # single-event transactions a second one nearly always waits, and every batch then
        # lingered: commit -> ack p50 12.8 ms against 5 with this.)
        if len(batch) < limit and not (lane.wal is not None and lane.wal.queued >= limit):
            # No backlog behind this batch, nothing to batch it with: send it without waiting
            # out the client's linger (Kafka). A full batch lingers, and batches on the wire.
            send_now(sink)
        sink.poll(0)  # sinks that queue what they were given send it now, as one burst
        return len(batch)

    @staticmethod
    def _span_shape(sink: Sink, outbox: str, topic: str) -> tuple[str, dict[str, Any]]:
        name, attributes = router.shape_of(sink, topic)
        return name, {**attributes, "outbox.name": outbox}

    @property
    def _metrics_on(self) -> bool:
        return self._health is not None or self._shared_metrics

    def _lane_error(self, lane: Lane, conn: psycopg.Connection[Any], error: str) -> None:
        lane.pause(error)
        try:
            conn.rollback()
        except psycopg.Error:
            self.sessions.discard(conn)
            return
        self.sessions.give_back(conn)

    def _finish_complete_batches(self) -> None:
        """Hand each batch whose every event has an outcome to a finisher thread, and record
        those finished. A lane's WAL batches commit one at a time, in the order read: each
        commits the slot position it reaches, and a later one committed first would have a
        restart skip the earlier one's events. So one complete while the one read before it
        is still on a finisher is handed over to wait for it there, and to commit only if that
        one did (the loop would see that one done only at its next look, up to REPORT_WAIT
        later, and the slot was then idle meanwhile); one that fails rewinds the reader and
        releases those read after it (see _done)."""
        for lane in list(self._busy):
            earlier: tuple[WalBatch, Future[BatchResult]] | None = None  # on a finisher, not done
            wal_waiting = False  # a WAL batch read earlier is not complete yet
            for batch in list(lane.in_flight):
                if batch not in lane.in_flight:  # abandoned by an earlier one's failure
                    continue
                pending = self._finishing.get(batch)
                if pending is not None:
                    # A WAL batch's result is taken only after the one before it: that one may
                    # have finished (and this one, behind it, given up) since it was looked at.
                    if pending[0].done() and (earlier is None or not isinstance(batch, WalBatch)):
                        self._finished(lane, batch)
                    elif isinstance(batch, WalBatch):
                        earlier = (batch, pending[0])
                    continue
                if isinstance(batch, WalBatch):
                    if batch.complete and not wal_waiting:
                        self._hand_over(lane, batch, earlier)
                        earlier = (batch, self._finishing[batch][0])
                    else:
                        wal_waiting = True
                elif batch.complete:
                    self._hand_over(lane, batch)

    def _hand_over(
        self, lane: Lane, batch: Batch, earlier: tuple[WalBatch, Future[BatchResult]] | None = None
    ) -> None:
        """Finish ``batch`` on a finisher thread: its statements and commit, a round trip the
        loop does not wait for. The next batch is produced meanwhile; the server's work of
        archiving one batch (about 20 ms for 1,000 events) was the loop's own wait before.
        ``earlier``: the WAL batch read before it, to wait for (see _finish_after)."""
        ack_start = time.time_ns()
        if earlier is None:
            future = self._finisher.submit(self._finish_batch, lane, batch)
        else:
            future = self._finisher.submit(self._finish_after, *earlier, lane, batch)
        self._finishing[batch] = (future, ack_start)

    def _finish_batch(self, lane: Lane, batch: Batch) -> BatchResult:
        """The batch's statements and commit (on a finisher, or on the loop)."""
        return batch.finish(
            lane.schema,
            self.config.retry,
            archive=self.config.archive,
            latencies=self._metrics_on,  # for the latency histogram only
        )

    def _finish_after(
        self, earlier: WalBatch, its: Future[BatchResult], lane: Lane, batch: Batch
    ) -> BatchResult:
        """On a finisher: wait for the WAL batch read before ``batch``, then finish ``batch`` if
        that one committed. If it did not, ``batch`` is left as it is, unwritten: the loop
        rewinds the reader and releases it with every batch read after the failed one. (Futures
        are handed over in the order read and never wait for a later one, and a lane's batches
        in flight each hold a session, so no more run than the finisher has threads.)"""
        its.exception()  # waits
        if not earlier.finished:
            raise _NotHandedOn("the WAL batch read before it did not commit")
        return self._finish_batch(lane, batch)

    def _await_finishing(self) -> None:
        """Wait for the finishers and record what they finished: before anything that rolls back,
        settles or finishes batches in flight on the loop itself (a finisher owns a batch's
        session until then)."""
        for lane in list(self._busy):
            for batch in list(lane.in_flight):
                pending = self._finishing.get(batch)
                if pending is not None:
                    pending[0].exception()  # waits
                    self._finished(lane, batch)

    def _finished(self, lane: Lane, batch: Batch) -> None:
        future, ack_start = self._finishing.pop(batch)
        exc = future.exception()
        if exc is None:
            self._after_finish(lane, batch, future.result(), ack_start)
        elif isinstance(exc, (FencingError, psycopg.Error)):
            self._after_finish(lane, batch, exc, ack_start)
        else:
            raise exc

    def _finish(self, lane: Lane, batch: Batch) -> None:
        """Finish ``batch`` on the loop (a sink replaced: its batches settled at once)."""
        ack_start = time.time_ns()
        outcome: BatchResult | Exception
        try:
            outcome = self._finish_batch(lane, batch)
        except (FencingError, psycopg.Error) as exc:
            outcome = exc
        self._after_finish(lane, batch, outcome, ack_start)

    def _after_finish(
        self, lane: Lane, batch: Batch, outcome: BatchResult | Exception, ack_start: int
    ) -> None:
        if isinstance(outcome, FencingError):
            self._lease_lost(lane, batch, str(outcome), ack_start)
            self._done(lane, batch)  # fenced: its partition was taken over, nothing about the sink
            return
        if isinstance(outcome, psycopg.Error):
            exc = outcome
            if batch.conn.closed or batch.conn.broken:
                # The lease ran out (idle_in_transaction_session_timeout ended the
                # session) or the connection broke: the ack did not commit.
                self._lease_lost(lane, batch, f"connection lost: {self.sessions.clean(exc)}", ack_start)
                self.sessions.discard(batch.conn)
                # The lease ran out (not a server restart or a dropped connection): too slow.
                self._pace(lane, batch, lost=time.monotonic() - batch.claimed_at >= self.config.lease)
            else:  # the statement failed on a live connection: a bug or a schema change
                log.error(
                    "ack of %d events failed, they stay pending: %s",
                    len(batch),
                    self.sessions.clean(exc),
                    extra={"outbox": lane.name},
                )
                self._end_spans(batch, ack_start, type(exc).__name__)
                batch.release()
            self._done(lane, batch)
            return
        assert isinstance(outcome, BatchResult)
        result = outcome
        self._done(lane, batch)
        self._record(lane, batch, result, ack_start)
        if result.delivered:  # a batch that only failed says nothing about the sink's pace
            self._pace(lane, batch, lost=False)

    def _pace(self, lane: Lane, batch: Batch, lost: bool) -> None:
        """Claim no more than the sink settles well within the lease.

        The row locks of a batch are its lease: a batch still out when the lease ends loses
        its session, and its events, sent already, are claimed and sent again. A sink that
        takes longer than the lease for a full batch (a webhook at a few requests a second; a
        queue service whose calls slow down; moto's SQS, at 3,000 queued: about 0.5 s a call)
        would then never finish one: every batch sent, none archived, for ever. So a batch
        that took more than SLOW_BATCH of the lease halves the next claims (a lost lease
        quarters them), and full batches settled quickly double them again, up to
        --batch-size. An outbox starts at START_CLAIM (a slow start), so that even the first
        batch to a slow sink fits its lease. One line when a slow batch first makes claims
        smaller, one when they are back to --batch-size."""
        full = self.config.batch_size
        cap = lane.claim_cap or full
        took = time.monotonic() - batch.claimed_at
        lease = self.config.lease
        # A batch slowed by an outage (the sink was found down while it was out, or some of its
        # sends failed only to reach it) says nothing of the sink's pace once it answers: the
        # blackhole's 16 s batches, finishing as the sink healed, cut the claims to 50 just when
        # the backlog had to drain.
        slow = lost or (took > SLOW_BATCH * lease and not self._outage(batch))  # rare: no scan per batch
        if slow:
            new = max(MIN_CLAIM, min(cap, len(batch)) // (4 if lost else 2))
        elif took < FAST_BATCH * lease and len(batch) >= cap and cap < full:
            new = min(full, cap * 2)
        else:
            return
        lane.claim_cap = 0 if new >= full else new
        if slow and not lane.paced:
            lane.paced = True
            log.warning(
                "%sa batch of %d events took %.1f s of the %.0f s lease%s: claiming at most %d events "
                "at a time while the sink is this slow",
                lane.said,
                len(batch),
                took,
                lease,
                " and lost it" if lost else "",
                new,
                extra={"event": "claims.paced", "outbox": lane.name},
            )
        elif new >= full and lane.paced:
            lane.paced = False
            log.warning(
                "%sthe sink keeps pace again: claiming up to %d events at a time",
                lane.said,
                full,
                extra={"event": "claims.unpaced", "outbox": lane.name},
            )

    def _outage(self, batch: Batch) -> bool:
        """Was the batch out while a heartbeat found a sink down, or did some of its events fail
        only because the sink could not be reached?"""
        if batch.claimed_at <= self._sinks_seen_down:
            return True
        return any(isinstance(o, Retry) and o.kind in UNREACHABLE_KINDS for o in batch.outcomes)

    def _lease_lost(self, lane: Lane, batch: Batch, why: str, ack_start: int) -> None:
        self.stats.leases_lost += 1
        lane.stats.leases_lost += 1
        self.metrics.leases_lost.inc((lane.name,))
        self._end_spans(batch, ack_start, "lease_lost")
        log.warning(
            "ack of %d events refused, they will be delivered again by their new owner: %s",
            len(batch),
            why,
            extra={"event": "lease.lost", "outbox": lane.name},
        )

    def _done(self, lane: Lane, batch: Batch) -> None:
        """The one place a batch leaves the loop: its session back to the pool, its key holds dropped;
        a WAL batch's position confirmed to the slot if it committed, else read again."""
        if batch not in lane.in_flight:  # abandoned already: a WAL batch read before it failed
            return
        lane.in_flight.remove(batch)
        lane.ordering.holds.release(id(batch))
        self.sessions.give_back(batch.conn)
        if not lane.in_flight:
            self._busy.pop(lane, None)
        if isinstance(batch, WalBatch) and lane.wal is not None:
            if batch.finished:
                lane.wal.confirm(batch.after)
                return
            # Not handed on: the slot sends it again, from the confirmed position; so every WAL
            # batch read after it goes too (sent again, and not archived twice).
            lane.wal.rewind()
            for later in [b for b in lane.in_flight if isinstance(b, WalBatch)]:
                waiting = self._finishing.pop(later, None)
                if waiting is not None:  # its finisher waited for this one: it gives up, unwritten
                    waiting[0].exception()
                self._end_spans(later, time.time_ns(), "released")
                later.release()
                lane.in_flight.remove(later)
                lane.ordering.holds.release(id(later))
                self.sessions.give_back(later.conn)
            if not lane.in_flight:
                self._busy.pop(lane, None)

    def _let_go_of_the_wal(self) -> None:
        """The database cannot be reached (take() waits to try again): WAL capture's readers let
        go of their streams. A reader keeps its stream open while the WAL it read is not handed
        on, and a server shutting down waits for its walsender until the reader confirms all it
        was sent (or wal_sender_timeout, 60 s): a restart stood still for a minute, pg_ctl gave
        up, and this loop waited on the very database that waited on it. So the WAL batches in
        flight are released (they cannot commit now) and the reader reads again once the
        database is back, from the position last committed."""
        self._await_finishing()
        for lane in self._rotation:
            if lane.wal is None:
                continue
            first = next((b for b in lane.in_flight if isinstance(b, WalBatch)), None)
            if first is None:
                lane.wal.rewind()  # what it queued, and its stream
                continue
            self._end_spans(first, time.time_ns(), "released")
            first.release()
            self._done(lane, first)  # rewinds the reader, releases the WAL batches read after it

    def _release_in_flight(self, why: str) -> None:
        """Roll back every in-flight batch: their events can be claimed again at once."""
        self._await_finishing()
        for lane in self._rotation:
            for batch in list(lane.in_flight):
                now = time.time_ns()
                self._end_spans(batch, now, "released")
                batch.release()
                self._done(lane, batch)
        if why:
            log.info("released in-flight batches: %s", why)

    # -- what a batch did: recorded once ------------------------------------------

    def _record(self, lane: Lane, batch: Batch, result: BatchResult, ack_start: int) -> None:
        """Spans, metrics, counters and logs of a committed batch, from its result."""
        if batch.spans:
            errors = {t: next(iter(r.errors)) for t, r in result.topics.items() if r.errors}
            tracing.end_batch(batch.spans, errors, ack_start, time.time_ns())
        metrics = self.metrics if self._metrics_on else None
        for topic, r in result.topics.items():
            for stats in (self.stats, lane.stats):
                stats.delivered += r.delivered
                stats.retried += r.retried
                stats.dead += r.dead
            if metrics is None:
                continue
            labels = (lane.name, topic, "none" if self._sink is None else router.name_of(self._sink, topic))
            if r.delivered:
                metrics.delivered.inc(labels, r.delivered)
                metrics.latency.observe_many(r.latencies, (lane.name,))
            for kind, n in r.errors.items():
                metrics.errors.inc((*labels, kind), n)
            if r.dead:
                metrics.dead.inc(labels, r.dead)
        for event_id, reason in result.dead_events:
            log.warning(
                "event %d dead-lettered: %s",
                event_id,
                reason,
                extra={"event": "event.dead", "outbox": lane.name},
            )
        retried = sum(r.retried for r in result.topics.values())
        settled = sum(r.delivered + r.dead for r in result.topics.values())
        if settled:
            lane.failing_since = 0.0
        elif retried and not lane.failing_since:
            lane.failing_since = batch.claimed_at  # every attempt of the batch failed
        if retried:
            kinds = sorted({kind for r in result.topics.values() for kind in r.errors})
            lane.delivery.fail(f"{retried} events of the last batch will be retried ({', '.join(kinds)})")
        elif any(r.delivered for r in result.topics.values()):
            lane.delivery.ok()

    def _end_spans(self, batch: Batch, ack_start: int, error: str) -> None:
        if batch.spans:
            tracing.end_batch(batch.spans, {}, ack_start, time.time_ns(), error)
            batch.spans = {}

    # -- the outboxes served -----------------------------------------------------

    def _apply_outboxes(self) -> None:
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
        self._forget_left()
        self._name_outage()

    def _name_outage(self) -> None:
        """The database's outage line names the outboxes it stops (but the lone default one)."""
        names = [lane.name for lane in self._rotation if not lane.leaving]
        if names == [DEFAULT_NAME] or not names:
            return
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        said = f"outbox {shown}" if len(names) == 1 else f"outboxes {shown}"
        self.sessions.database.description = f"{said}: cannot reach PostgreSQL"
        self.sessions.database.fields = {"outbox": ",".join(names)}
        self.loop_stall.description = f"{said}: the database has not answered"
        self.loop_stall.fields = {"outbox": ",".join(names)}

    def _join(self, o: Outbox) -> None:
        ordering = Ordering(
            link=self._link,
            schema=o.schema,
            name=self.config.name,
            lease=self.config.ownership_lease,
            batch_lease=self.config.lease,
            ordering=self.config.ordering,
            on_dead=self.config.on_dead,
            outbox=o.name,
        )
        if self.running.is_set():
            # Joining a running relay: its first heartbeat at a random point of the interval.
            ordering.delay_first_heartbeat(random.uniform(0, ordering.interval))
        start = START_CLAIM if self.config.batch_size > START_CLAIM else 0  # 0: --batch-size
        lane = Lane(o, ordering, next_maintenance=0.0, claim_cap=start)
        self.lanes[o.name] = lane
        self._rotation.append(lane)
        self._beats.schedule(lane)
        if self._sink is not None:
            self._chain(lane)
        if self._listener is not None:
            self._listener.watch(channel_name(o.schema), partial(self._woken, lane))
        if self.running.is_set():
            log.info("serving outbox %s", o.display, extra={"event": "outbox.joined", "outbox": o.name})

    def _leave(self, lane: Lane) -> None:
        if not lane.leaving:
            lane.leaving = True
            log.info(
                "outbox %s is no longer served",
                lane.name,
                extra={"event": "outbox.left", "outbox": lane.name},
            )

    def _forget_left(self) -> None:
        """Lanes that left and have nothing in flight hand their partitions over and go."""
        for lane in [lane for lane in self._rotation if lane.leaving and not lane.in_flight]:
            self._stop_reader(lane)
            lane.ordering.release_all()
            self._rotation.remove(lane)
            self._beats.forget(lane)
            del self.lanes[lane.name]
            self._chains.pop(lane.name, None)
            if self._listener is not None:
                self._listener.unwatch(channel_name(lane.schema))
            self._turn = 0
            m = self.metrics  # the gauges of an outbox no longer served go (its counters stay)
            for gauge in (m.pending, m.oldest_age, m.dead_tuples, m.table_bytes, m.oldest_xmin, m.up):
                gauge.forget(0, lane.name)
            m.owned_partitions.forget(0, lane.name)

    def _woken(self, lane: Lane) -> None:
        """A NOTIFY for this outbox (the listener's thread): claim it at the next step."""
        lane.table_news = True
        lane.woken = True
        self._wakeup.set()

    def _wal_read(self, lane: Lane) -> None:
        """The WAL reader queued a transaction (its thread): send it at the next step. Not a sign
        of rows in the table: marking the table due here made every other WAL batch wait for an
        empty claim of it (a round trip, and commit -> ack p50 6.6 ms against 4.2 for the table)."""
        lane.woken = True
        self._wakeup.set()

    # -- sessions, sink, maintenance ------------------------------------------------

    def _replace_sink(self) -> None:
        if self._sink is not None:
            self._await_finishing()
            self.stats.sinks_replaced += 1
            self.metrics.sinks_replaced.inc()
            in_flight = [(lane, b) for lane in self._rotation for b in lane.in_flight]
            log.error(
                "sink unhealthy, replacing it; settling %d in-flight batches",
                len(in_flight),
                extra={"event": "sink.replaced"},
            )
            # The old client reports what it can (Kafka: what was acked, and its purged messages
            # as failed) and goes. The in-flight batches are then finished, not rolled back: what
            # was delivered is archived once, not sent again by the next claim; the rest counts
            # as failed for an unreachable sink (the key holds its later events, per-key order),
            # due again as soon as the replacement answers (_sinks_back), not after a backoff.
            self._sink.close(0)
            unreported = Retry(SINK_REPLACED, "the sink's client was replaced before it reported")
            for lane, batch in in_flight:
                for i, outcome in enumerate(batch.outcomes):
                    if outcome is None:
                        batch.settle(i, unreported)
                self._finish(lane, batch)
            for lane in self._rotation:
                lane.sinks_were_down = True
        self._sink = self._sink_factory()
        self._chains = {}
        for lane in self._rotation:
            self._chain(lane)

    def _chain(self, lane: Lane) -> None:
        """A sink that cannot order a key's in-flight events gets key chains, one set per outbox:
        keys are an outbox's own, and one outbox's failure must not hold another's events. A
        router over several sinks gets them too, across its sinks: a key's event waits for the
        key's events in flight to another sink (chains.py)."""
        assert self._sink is not None
        inner = router.unwrap(self._sink)
        if lane.ordering.ordered and not getattr(inner, "keeps_key_order", True):
            route = inner.destination if isinstance(inner, router.Router) else None
            self._chains[lane.name] = KeyChains(self._sink, parks=lane.ordering.parks, route=route)

    def _heartbeat(self, lane: Lane, readiness: str) -> None:
        # The pids are recorded for operators (outbox status, pg_stat_activity), not for fencing.
        conns = [b.conn for b in lane.in_flight]
        pids = self.sessions.idle_pids() + [
            pid for c in conns if not c.closed and (pid := self.sessions.pid(c)) is not None
        ]
        ordering = lane.ordering
        lost_before = ordering.lost_partitions
        if ordering.tick(pids, (id(b) for b in lane.in_flight), self.sessions.stale, readiness):
            lane.woken = lane.table_news = True  # new partitions: there may be work right now
        if not ordering.heartbeat.active:
            self._loop_progress = time.monotonic()
        if self._metrics_on:
            self.metrics.owned_partitions.set(len(ordering.owned), (lane.name,))
            self.metrics.partitions_lost.inc((lane.name,), ordering.lost_partitions - lost_before)

    def _sinks_back(self, lanes: list[Lane]) -> None:
        """With the heartbeats of the loop: probe the sinks counted down; when every sink answers again after
        an outage, the events of each outbox that failed only for that are due at once, not after their
        backoff."""
        sink = self._sink
        if sink is None:
            return
        down = False
        for each in router.sinks_of(sink):
            inner = router.unwrap(each)
            if getattr(inner, "trouble", None) is not None and inner.trouble():
                if hasattr(inner, "probe"):
                    inner.probe()
                down = down or bool(inner.trouble())
        if down:
            self._sinks_seen_down = time.monotonic()
            for lane in self._rotation:
                lane.sinks_were_down = True
            return
        for lane in lanes:
            if lane.sinks_were_down:
                self._retry_unreachable_now(lane)

    def _retry_unreachable_now(self, lane: Lane) -> None:
        conn = self.sessions.take()
        if conn is None:
            return
        try:
            n = conn.execute(
                query("retry_unreachable_now", lane.schema), {"kinds": sorted(UNREACHABLE_KINDS)}
            ).rowcount
            conn.commit()
        except psycopg.OperationalError as exc:
            self.sessions.lost(conn, f"retrying after the outage failed: {self.sessions.clean(exc)}")
            return
        except psycopg.Error as exc:
            self._lane_error(lane, conn, f"retrying after the outage failed: {self.sessions.clean(exc)}")
            return
        self.sessions.give_back(conn)
        lane.sinks_were_down = False
        if n > 0:
            log.info(
                "sinks answer again: %d events that failed to reach them are due now",
                n,
                extra={"outbox": lane.name},
            )
            lane.woken = lane.table_news = True

    def _maintain_partitions(self, now: float) -> None:
        """The archive's day partitions of each outbox whose hourly check is due (one a step)."""
        due = [lane for lane in self._rotation if now >= lane.next_maintenance and not lane.leaving]
        if not due:
            self._next_maintenance_check = min(
                (lane.next_maintenance for lane in self._rotation), default=now + PARTITION_MAINTENANCE
            )
            return
        lane = due[0]
        lane.next_maintenance = now + PARTITION_MAINTENANCE
        done = self._on_session(
            lane,
            "archive partition maintenance",
            lambda conn: conn.execute(query("ensure_partitions", lane.schema)),
        )
        if done is None:
            lane.next_maintenance = now + MAINTENANCE_RETRY

    def _on_session(self, lane: Lane, what: str, work: Callable[[psycopg.Connection[Any]], T]) -> T | None:
        """``work`` on a session of the pool, committed; its result, or None when no session was
        free or it failed (said once: the session lost, or this outbox's own trouble)."""
        conn = self.sessions.take()
        if conn is None:
            return None
        try:
            result = work(conn)
            conn.commit()
        except psycopg.OperationalError as exc:
            self.sessions.lost(conn, f"{what} failed: {self.sessions.clean(exc)}")
            return None
        except psycopg.Error as exc:
            self._lane_error(lane, conn, f"{what} failed: {self.sessions.clean(exc)}")
            return None
        self.sessions.give_back(conn)
        return result

    def _check_capture(self, now: float) -> None:
        """Each outbox's capture mode, every CAPTURE_CHECK s (one outbox a step): a slot to read
        starts its reader; a slot that went (dropped) stops it."""
        due = [lane for lane in self._rotation if now >= lane.next_capture and not lane.leaving]
        if not due:
            self._next_capture_check = min(
                (lane.next_capture for lane in self._rotation), default=now + CAPTURE_CHECK
            )
            return
        self._check_lane_capture(due[0], now)

    def _check_lane_capture(self, lane: Lane, now: float) -> None:
        lane.next_capture = now + CAPTURE_CHECK
        found = self._on_session(lane, "capture check", lambda conn: capture.state(conn, lane.schema))
        if found is None:
            lane.next_capture = now + MAINTENANCE_RETRY
            return
        lane.capture_mode = found.mode
        if found.reads_slot and lane.wal is None:
            lane.wal = WalReader(
                lane.outbox.dsn,
                lane.schema,
                found,
                partial(self._wal_read, lane),
                name=lane.said and lane.name,
            )
            lane.wal.start()
            log.info(
                "%sreading events from the WAL slot %s (%s capture)",
                lane.said,
                found.slot,
                found.mode,
                extra={"event": "wal.reading", "outbox": lane.name},
            )
        elif (
            not found.reads_slot
            and lane.wal is not None
            and not any(isinstance(b, WalBatch) for b in lane.in_flight)
        ):
            self._stop_reader(lane)

    def _stop_reader(self, lane: Lane) -> None:
        if lane.wal is not None:
            lane.wal.stop()
            lane.wal.join(timeout=2.0)
            lane.wal = None

    # -- start and stop ---------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        if config.metrics_port is not None and not self._shared_metrics:
            self.gauges = DatabaseGauges(self._dsn, lambda: self.outboxes, self.metrics)
            self._health = HealthServer(
                config.metrics_host, config.metrics_port, self.metrics, [self.gauges], self.ready
            ).start()
            log.info("serving /metrics, /livez, /readyz on %s:%d", config.metrics_host, self._health.port)
        elif self._shared_metrics:
            self.gauges = DatabaseGauges(self._dsn, lambda: self.outboxes, self.metrics)
        if config.notify:
            self._listener = Listener(self._dsn, self._stop)
        self._chains = {}
        self._sink = self._sink_factory()
        self._apply_outboxes()
        for lane in self._rotation:
            self._heartbeat(
                lane, "starting"
            )  # join and take a share of the partitions before the first claim
        for k, lane in enumerate(self._rotation):
            if k:  # from here on, the outboxes' heartbeats spread over the interval, not all in one step
                lane.ordering.delay_first_heartbeat(random.uniform(0, lane.ordering.interval))
            self._beats.schedule(lane)
        if config.vacuum:
            self._hygiene = Hygiene(
                self._dsn, lambda: [lane.schema for lane in self._rotation], self._stop,
                threshold=config.vacuum_threshold,
            )  # fmt: skip
            self._hygiene.start()
        if self._listener is not None:
            self._listener.start()
        self._watchdog = threading.Thread(target=self._watch, name="outbox-watchdog", daemon=True)
        self._watchdog.start()
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

    def _watch(self) -> None:
        """Every second: has the loop completed a claim or a heartbeat within the stall timeout?
        One line when it has not (the loop is stuck in a statement), one when it has again."""
        limit = max(self.config.stall_timeout, 2 * self.config.poll_interval)
        while not self._stop.wait(WATCH_EVERY):
            age = time.monotonic() - self._loop_progress
            lanes = list(self.lanes.values())
            said = self.sessions.database.active or any(lane.ordering.heartbeat.active for lane in lanes)
            if age > limit and not said:  # an error already said it: one problem, one line
                self.loop_stall.fail(f"no claim or heartbeat completed for {age:.0f} s")
            else:
                self.loop_stall.ok()

    def _shutdown(self) -> None:
        """Stop claiming; give in-flight batches the grace budget; release the rest."""
        deadline = time.monotonic() + self.config.grace
        while any(lane.in_flight for lane in self._rotation) and self._sink is not None:
            if time.monotonic() >= deadline:
                break
            self._sink.poll(REPORT_WAIT_FULL)
            self._finish_complete_batches()
        unfinished = sum(len(lane.in_flight) for lane in self._rotation)
        if unfinished:
            log.warning(
                "grace budget spent: releasing %d unfinished batches (their events stay pending)", unfinished
            )
            self._release_in_flight("")
        self._finisher.shutdown()
        if self._sink is not None:
            self._sink.close(max(0.0, min(1.0, deadline - time.monotonic())))
            self._sink = None
        # No batch holds locks any more: hand the partitions over at once.
        for lane in self._rotation:
            self._stop_reader(lane)
            lane.ordering.release_all()
        self._link.close()
        self.sessions.close_all()
        if self._listener is not None:
            self._listener.join(timeout=2.0)
        if self._hygiene is not None:
            self._hygiene.join(timeout=2.0)
        if self._health is not None:
            self._health.stop()
            self._health = None
        log.info(
            "relay stopped: delivered=%d retried=%d dead=%d",
            self.stats.delivered,
            self.stats.retried,
            self.stats.dead,
        )
