"""The relay: claim committed events, publish them, record what happened.

One loop, readable top to bottom::

    while not stopping:
        finish the batches whose every event has an outcome   (ack/retry/dead + commit)
        if a connection is free and there may be work:       claim a batch, produce it
                                                              (empty, with batches out: serve reports)
        else:                                                 serve delivery reports, or sleep
                                                              until NOTIFY / the poll timer

Pipelining: up to ``max_batches_in_flight`` batches are out at once, each in its
own transaction on its own connection, so the next batch is produced while the
previous one awaits its acks. Capacity bounds the claim: never more than
``batch_size × max_batches_in_flight`` events are held.

A batch leaves the loop in one place (:meth:`Relay._done`), which gives its
connection back and drops its key holds; what it did is recorded in one place
(:meth:`Relay._record`): spans, metrics, counters and logs.
"""

from __future__ import annotations

import gc
import logging
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg

from outbox import tracing
from outbox.batch import Batch, BatchResult
from outbox.conditions import Condition
from outbox.config import RelayConfig
from outbox.dsn import with_net_timeouts
from outbox.errors import FencingError
from outbox.hygiene import Hygiene
from outbox.listener import Listener
from outbox.metrics import DatabaseGauges, HealthServer, RelayMetrics
from outbox.ordering import Ordering
from outbox.queries import query
from outbox.sessions import Sessions
from outbox.sinks import router
from outbox.sinks.base import SINK_REPLACED, UNREACHABLE_KINDS, Retry, Sink, send_now
from outbox.sinks.chains import KeyChains

__all__ = ["Relay", "RelayConfig", "RelayStats"]

log = logging.getLogger("outbox.relay")

PARTITION_MAINTENANCE = 3600.0  # seconds between archive partition checks
MAINTENANCE_RETRY = 10.0  # seconds before trying again after it failed
REPORT_WAIT = 0.005  # seconds to wait for delivery reports while a claim could start
REPORT_WAIT_FULL = 0.05  # seconds to wait for delivery reports when all slots are busy
NET_PAUSE = 1.0  # seconds to pause after a dropped connection caught by the loop's net


GC_THRESHOLD = 50_000  # allocations between collections of the youngest generation (Python: 700)


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


@dataclass
class RelayStats:
    claims: int = 0  # claim statements that went through, empty or not
    claimed: int = 0  # events claimed
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    leases_lost: int = 0
    sinks_replaced: int = 0


class Relay:
    """One worker: a loop over claimed batches. Call ``run()``; ``stop()`` from anywhere."""

    def __init__(self, config: RelayConfig, sink_factory: Callable[[], Sink]) -> None:
        self.config = config
        self._sink_factory = sink_factory
        self._sink: Sink | None = None
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        # Every connection of the relay notices a dead peer within net_timeout seconds.
        self._dsn = with_net_timeouts(config.dsn, config.net_timeout)
        self.sessions = Sessions(self._dsn, lease=config.lease, stop=self._stop)
        self._in_flight: list[Batch] = []
        self._more_work = True  # claim at once on start
        self._next_poll = 0.0
        self._next_maintenance = 0.0
        self._listener: Listener | None = None
        self._hygiene: Hygiene | None = None
        self.ordering = Ordering(
            connect=self.sessions.connect,
            schema=config.schema,
            name=config.name,
            lease=config.ownership_lease,
            batch_lease=config.lease,
            ordering=config.ordering,
            on_dead=config.on_dead,
        )
        self.stats = RelayStats()
        self.running = threading.Event()  # set once connected and producing
        self.metrics = RelayMetrics()
        self._health: HealthServer | None = None
        # Retries batch after batch are one problem, not a line per batch.
        self.delivery = Condition(log, "delivery", "deliveries failing")
        # The watchdog behind /readyz: when the loop last completed a claim or a heartbeat,
        # and when a sink last reported on a batch (monotonic seconds).
        self._loop_progress = time.monotonic()
        self._sink_progress = time.monotonic()
        self._waiting = 0  # events in flight awaiting a report, at the last loop step
        self._sinks_were_down = False  # a sink was down since the last "retry now"
        # Since when every finished batch had only failed attempts (0: the last one delivered).
        self._failing_since = 0.0

    # -- public -----------------------------------------------------------------

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
        """For /readyz: database reachable, every sink up, not shutting down.

        The first line says why (or ``ready``); then one line per sink."""
        if self._stop.is_set():
            return False, "draining: shutting down"
        if not self.running.is_set():
            return False, "starting"
        sink = self._sink
        if sink is None or not sink.healthy():
            return False, "sink unhealthy"
        trouble, states = router.states_of(sink)
        detail = "".join(f"\n{line}" for line in states)
        if self.sessions.database.active or self.ordering.heartbeat.active:
            return False, "database unreachable" + detail
        if trouble:
            return False, f"sink down: {trouble[0]}" + detail
        stalled = self.stalled()
        if stalled:
            return False, stalled + detail
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
        if self._failing_since and now - self._failing_since > limit:
            return f"stalled: every delivery attempt failed for {now - self._failing_since:.0f} s"
        flights = list(self._in_flight)  # read from the health server's thread: a copy
        if flights:
            oldest = min(b.claimed_at for b in flights)
            quiet = now - max(self._sink_progress, oldest)
            if quiet > limit:
                return f"stalled: {len(flights)} batches in flight, no delivery report for {quiet:.0f} s"
        return None

    # -- the loop ---------------------------------------------------------------

    def _step(self) -> None:
        waiting = sum(b.waiting for b in self._in_flight)
        if waiting != self._waiting:  # a sink reported (or a batch came or went)
            self._waiting = waiting
            self._sink_progress = time.monotonic()
        self._finish_complete_batches()
        if self._sink is None or not self._sink.healthy():
            self._replace_sink()
        if self.ordering.due():
            if not self._in_flight and self._sink is not None:
                # Idle, nothing else reads the sinks' clients: serve their callbacks here, so that a
                # broker that went away is seen (readiness, the outage's log line) before events are due.
                self._sink.poll(0)
            self._heartbeat()
            self._sinks_back()
        now = time.monotonic()
        if now >= self._next_maintenance:
            self._maintain_partitions()
        slot_free = len(self._in_flight) < self.config.max_batches_in_flight
        due = self._more_work or self._wakeup.is_set() or now >= self._next_poll
        if slot_free and due:
            self._wakeup.clear()  # a NOTIFY arriving during the claim sets it again
            claimed = self._claim_and_send()
            # A full batch means there is probably more: claim again without waiting.
            self._more_work = claimed == self.config.batch_size
            if not self._more_work:
                self._next_poll = time.monotonic() + self._jittered_poll()
            if claimed == 0 and self._in_flight:
                # Serve the reports of the batches in flight before the next claim: when every
                # pending key waits behind them (after an outage) and writers keep notifying,
                # claims come back empty one after another, and without this the loop would
                # never read the reports that finish those batches (until their lease ran out).
                assert self._sink is not None
                self._sink.poll(REPORT_WAIT)
        elif self._in_flight:
            assert self._sink is not None
            self._sink.poll(REPORT_WAIT if slot_free else REPORT_WAIT_FULL)
        else:
            # Idle: sleep until the next poll, NOTIFY, or the next heartbeat (a long
            # poll interval must not let the ownership leases lapse).
            self._wakeup.wait(min(max(0.0, self._next_poll - now), self.ordering.seconds_until_due()))

    def _jittered_poll(self) -> float:
        # Jitter keeps many relays from polling in step.
        return self.config.poll_interval * random.uniform(0.5, 1.5)

    def _claim_and_send(self) -> int:
        assert self._sink is not None
        conn = self._session()
        if conn is None:
            return 0
        claim_start = time.time_ns()
        try:
            rows = self.ordering.claim(conn, self.config.batch_size)
            if not rows:
                conn.rollback()
        except psycopg.Error as exc:
            # Connection gone, server restarting, session ended (also between an
            # empty claim and its rollback): nothing was claimed that will not be
            # claimed again.
            self.sessions.lost(conn, f"claim failed: {self.sessions.clean(exc)}")
            return 0
        self.sessions.database.ok()  # the claim went through, empty or not
        self._loop_progress = time.monotonic()
        self.stats.claims += 1
        if not rows:
            self.sessions.give_back(conn)
            return 0
        ordering = self.ordering
        batch = Batch(conn, rows, holds=ordering.holds if ordering.ordered else None, parks=ordering.parks)
        sink = self._sink
        batch.spans = tracing.start_batch(
            batch.events, claim_start, time.time_ns(), lambda topic: router.shape_of(sink, topic)
        )
        self.stats.claimed += len(batch)
        if self._health is not None:
            self.metrics.batch_size.observe(len(batch))
        # Per-key order: once an event of key K fails (in this batch or in one
        # still in flight), K's later events are held: left pending, untouched.
        # When the failure is committed, the claim query blocks them instead.
        held = ordering.holds.keys if ordering.ordered else None
        events = batch.events
        start = 0
        produce_many = getattr(self._sink, "produce_many", None)
        if produce_many is not None and not held and not batch.corrupt:
            # Nothing held, nothing corrupt: the batch goes to the sink in one call
            # (KafkaSink.produce_many), up to the first event the sink does not take as it is.
            start = produce_many(events, batch.outcomes, batch.settle)
        produce = self._sink.produce
        for i in range(start, len(events)):
            event = events[i]
            if event is None:  # corrupt row, already settled as dead
                continue
            if held and event.key is not None and event.key in held:
                batch.hold(i)
                continue
            outcome = produce(event, partial(batch.settle, i))
            if outcome is not None:
                batch.settle(i, outcome)
        self._in_flight.append(batch)
        if len(batch) < self.config.batch_size:
            # No backlog behind this batch, nothing to batch it with: send it without waiting
            # out the client's linger (Kafka). A full batch lingers, and batches on the wire.
            send_now(self._sink)
        self._sink.poll(0)  # sinks that queue what they were given send it now, as one burst
        return len(batch)

    def _finish_complete_batches(self) -> None:
        for batch in [b for b in self._in_flight if b.complete]:
            self._finish(batch)

    def _finish(self, batch: Batch) -> None:
        ack_start = time.time_ns()
        try:
            result = batch.finish(
                self.config.schema,
                self.config.retry,
                archive=self.config.archive,
                latencies=self._health is not None,  # for the latency histogram only
            )
        except FencingError as exc:
            self._lease_lost(batch, str(exc), ack_start)
            self._done(batch)
            return
        except psycopg.Error as exc:
            if batch.conn.closed or batch.conn.broken:
                # The lease ran out (idle_in_transaction_session_timeout ended the
                # session) or the connection broke: the ack did not commit.
                self._lease_lost(batch, f"connection lost: {self.sessions.clean(exc)}", ack_start)
                self.sessions.discard(batch.conn)
            else:  # the statement failed on a live connection: a bug or a schema change
                log.error(
                    "ack of %d events failed, they stay pending: %s", len(batch), self.sessions.clean(exc)
                )
                self._end_spans(batch, ack_start, type(exc).__name__)
                batch.release()
            self._done(batch)
            return
        self._done(batch)
        self._record(batch, result, ack_start)

    def _lease_lost(self, batch: Batch, why: str, ack_start: int) -> None:
        self.stats.leases_lost += 1
        self.metrics.leases_lost.inc()
        self._end_spans(batch, ack_start, "lease_lost")
        log.warning(
            "ack of %d events refused, they will be delivered again by their new owner: %s",
            len(batch),
            why,
            extra={"event": "lease.lost"},
        )

    def _done(self, batch: Batch) -> None:
        """The one place a batch leaves the loop: its session back to the pool, its key holds dropped."""
        self._in_flight.remove(batch)
        self.ordering.holds.release(id(batch))
        self.sessions.give_back(batch.conn)

    def _release_in_flight(self, why: str) -> None:
        """Roll back every in-flight batch: their events can be claimed again at once."""
        for batch in list(self._in_flight):
            now = time.time_ns()
            self._end_spans(batch, now, "released")
            batch.release()
            self._done(batch)
        if why:
            log.info("released in-flight batches: %s", why)

    # -- what a batch did: recorded once ------------------------------------------

    def _record(self, batch: Batch, result: BatchResult, ack_start: int) -> None:
        """Spans, metrics, counters and logs of a committed batch, from its result."""
        if batch.spans:
            errors = {t: next(iter(r.errors)) for t, r in result.topics.items() if r.errors}
            tracing.end_batch(batch.spans, errors, ack_start, time.time_ns())
        stats = self.stats
        metrics = self.metrics if self._health is not None else None
        for topic, r in result.topics.items():
            stats.delivered += r.delivered
            stats.retried += r.retried
            stats.dead += r.dead
            if metrics is None:
                continue
            labels = (topic, "none" if self._sink is None else router.name_of(self._sink, topic))
            if r.delivered:
                metrics.delivered.inc(labels, r.delivered)
                metrics.latency.observe_many(r.latencies)
            for kind, n in r.errors.items():
                metrics.errors.inc((*labels, kind), n)
            if r.dead:
                metrics.dead.inc(labels, r.dead)
        for event_id, reason in result.dead_events:
            log.warning("event %d dead-lettered: %s", event_id, reason, extra={"event": "event.dead"})
        retried = sum(r.retried for r in result.topics.values())
        settled = sum(r.delivered + r.dead for r in result.topics.values())
        if settled:
            self._failing_since = 0.0
        elif retried and not self._failing_since:
            self._failing_since = batch.claimed_at  # every attempt of the batch failed
        if retried:
            kinds = sorted({kind for r in result.topics.values() for kind in r.errors})
            self.delivery.fail(f"{retried} events of the last batch will be retried ({', '.join(kinds)})")
        elif any(r.delivered for r in result.topics.values()):
            self.delivery.ok()

    def _end_spans(self, batch: Batch, ack_start: int, error: str) -> None:
        if batch.spans:
            tracing.end_batch(batch.spans, {}, ack_start, time.time_ns(), error)
            batch.spans = {}

    # -- sessions, sink, maintenance ------------------------------------------------

    def _session(self) -> psycopg.Connection[Any] | None:
        """A free session; a new one registers its pid before it can lock anything."""
        conn, new = self.sessions.take()
        if conn is not None and new and self.ordering.ordered:
            # A relay taking over our partitions fences them while our sessions live.
            self._heartbeat(extra=conn)
        return conn

    def _replace_sink(self) -> None:
        if self._sink is not None:
            self.stats.sinks_replaced += 1
            self.metrics.sinks_replaced.inc()
            log.error(
                "sink unhealthy, replacing it; settling %d in-flight batches",
                len(self._in_flight),
                extra={"event": "sink.replaced"},
            )
            # The old client reports what it can (Kafka: what was acked, and its purged messages
            # as failed) and goes. The in-flight batches are then finished, not rolled back: what
            # was delivered is archived once, not sent again by the next claim; the rest counts
            # as failed for an unreachable sink (the key holds its later events, per-key order),
            # due again as soon as the replacement answers (_sinks_back), not after a backoff.
            self._sink.close(0)
            unreported = Retry(SINK_REPLACED, "the sink's client was replaced before it reported")
            for batch in list(self._in_flight):
                for i, outcome in enumerate(batch.outcomes):
                    if outcome is None:
                        batch.settle(i, unreported)
                self._finish(batch)
            self._sinks_were_down = True
        self._sink = self._new_sink()

    def _new_sink(self) -> Sink:
        """A sink from the factory; one that cannot order a key's in-flight events gets key chains."""
        sink = self._sink_factory()
        if self.ordering.ordered and not getattr(router.unwrap(sink), "keeps_key_order", True):
            sink = KeyChains(sink, parks=self.ordering.parks)
        return sink

    def _heartbeat(self, extra: psycopg.Connection[Any] | None = None) -> None:
        conns = [b.conn for b in self._in_flight] + ([extra] if extra is not None else [])
        pids = self.sessions.idle_pids() + [
            pid for c in conns if not c.closed and (pid := self.sessions.pid(c)) is not None
        ]
        lost_before = self.ordering.lost_partitions
        readiness = self.ready()[1].split("\n", 1)[0].split(":", 1)[0]  # the kind, never the detail
        if self.ordering.tick(pids, (id(b) for b in self._in_flight), self.sessions.stale, readiness):
            self._wakeup.set()  # new partitions: there may be work right now
        if not self.ordering.heartbeat.active:
            self._loop_progress = time.monotonic()
        self.metrics.owned_partitions.set(len(self.ordering.owned))
        self.metrics.partitions_lost.inc((), self.ordering.lost_partitions - lost_before)

    def _sinks_back(self) -> None:
        """With each heartbeat of the loop: probe the sinks counted down; when every sink answers again after
        an outage, the events that failed only for that are due at once, not after their backoff."""
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
            self._sinks_were_down = True
            return
        if not self._sinks_were_down:
            return
        conn = self._session()
        if conn is None:
            return
        try:
            n = conn.execute(
                query("retry_unreachable_now", self.config.schema), {"kinds": sorted(UNREACHABLE_KINDS)}
            ).rowcount
            conn.commit()
        except psycopg.Error as exc:
            self.sessions.lost(conn, f"retrying after the outage failed: {self.sessions.clean(exc)}")
            return
        self.sessions.give_back(conn)
        self._sinks_were_down = False
        if n > 0:
            log.info("sinks answer again: %d events that failed to reach them are due now", n)
            self._wakeup.set()

    def _maintain_partitions(self) -> None:
        self._next_maintenance = time.monotonic() + PARTITION_MAINTENANCE
        conn = self._session()
        if conn is None:
            return
        try:
            conn.execute(query("ensure_partitions", self.config.schema))
            conn.commit()
        except psycopg.OperationalError as exc:
            self.sessions.lost(conn, f"archive partition maintenance failed: {self.sessions.clean(exc)}")
            self._next_maintenance = time.monotonic() + MAINTENANCE_RETRY
            return
        except psycopg.Error as exc:
            log.error("archive partition maintenance failed: %s", self.sessions.clean(exc))
            try:
                conn.rollback()
            except psycopg.Error:
                self.sessions.lost(conn, "archive partition maintenance: connection lost")
                return
        self.sessions.give_back(conn)

    # -- start and stop ---------------------------------------------------------

    def _start(self) -> None:
        config = self.config
        if config.metrics_port is not None:
            gauges = DatabaseGauges(self._dsn, config.schema, self.metrics)
            self._health = HealthServer(
                config.metrics_host, config.metrics_port, self.metrics, gauges, self.ready
            ).start()
            log.info("serving /metrics, /livez, /readyz on %s:%d", config.metrics_host, self._health.port)
        self._sink = self._new_sink()
        self._heartbeat()  # join and take a share of the partitions before the first claim
        if config.vacuum:
            self._hygiene = Hygiene(self._dsn, config.schema, self._stop, threshold=config.vacuum_threshold)
            self._hygiene.start()
        if config.notify:
            self._listener = Listener(self._dsn, config.schema, self._wakeup, self._stop)
            self._listener.start()
        log.info(
            "relay %s started: schema=%s ordering=%s on-dead=%s batch=%d in-flight batches=%d "
            "lease=%ss notify=%s",
            self.ordering.id,
            config.schema,
            config.ordering,
            config.on_dead,
            config.batch_size,
            config.max_batches_in_flight,
            config.lease,
            config.notify,
        )

    def _shutdown(self) -> None:
        """Stop claiming; give in-flight batches the grace budget; release the rest."""
        deadline = time.monotonic() + self.config.grace
        while self._in_flight and self._sink is not None and time.monotonic() < deadline:
            self._sink.poll(REPORT_WAIT_FULL)
            self._finish_complete_batches()
        if self._in_flight:
            log.warning(
                "grace budget spent: releasing %d unfinished batches (their events stay pending)",
                len(self._in_flight),
            )
            self._release_in_flight("")
        if self._sink is not None:
            self._sink.close(max(0.0, min(1.0, deadline - time.monotonic())))
            self._sink = None
        # No batch holds locks any more: hand the partitions over at once.
        self.ordering.release_all()
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
