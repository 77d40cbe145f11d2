"""The relay: claim committed events, publish them, record what happened.

One loop, readable top to bottom::

    while not stopping:
        finish the batches whose every event has an outcome   (ack/retry/dead + commit)
        if a connection is free and there may be work:       claim a batch, produce it
        else:                                                 serve delivery reports, or sleep
                                                              until NOTIFY / the poll timer

Pipelining: up to ``max_batches_in_flight`` batches are out at once, each in its
own transaction on its own connection, so the next batch is produced while the
previous one awaits its acks. Capacity bounds the claim: never more than
``batch_size × max_batches_in_flight`` events are held.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import psycopg
from tenacity import (
    Retrying,
    retry_if_exception_type,
    stop_when_event_set,
    wait_exponential_jitter,
)

from outbox import tracing
from outbox.batch import Batch, FencingError
from outbox.dsn import scrub, secrets_of
from outbox.hygiene import DEAD_TUPLES_THRESHOLD, Hygiene
from outbox.listener import Listener
from outbox.metrics import DatabaseGauges, HealthServer, RelayMetrics, error_type
from outbox.ownership import OWNERSHIP_LEASE, Ownership
from outbox.queries import query
from outbox.retry import RetryPolicy
from outbox.schema import DEFAULT_SCHEMA, channel_name, validate_schema
from outbox.sinks.base import Dead, Delivered, Sink

log = logging.getLogger("outbox.relay")

BATCH_SIZE = 2000  # events per claim
MAX_BATCHES_IN_FLIGHT = 2  # claimed batches awaiting acks at once (one connection each)
LEASE = 30.0  # seconds a stalled worker keeps its batch before PostgreSQL ends its session
DELIVERY_TIMEOUT = 15.0  # seconds the sink may take to ack; must be well under LEASE
POLL_INTERVAL = 1.0  # seconds between polls when idle (jittered ±50%); NOTIFY wakes sooner
GRACE = 20.0  # seconds to finish in-flight batches at shutdown
ORDERINGS = ("key", "none")
ON_DEAD = ("park", "continue")
PARTITION_MAINTENANCE = 3600.0  # seconds between archive partition checks
REPORT_WAIT = 0.005  # seconds to wait for delivery reports while a claim could start
REPORT_WAIT_FULL = 0.05  # seconds to wait for delivery reports when all slots are busy


@dataclass
class RelayConfig:
    dsn: str
    schema: str = DEFAULT_SCHEMA
    batch_size: int = BATCH_SIZE
    max_batches_in_flight: int = MAX_BATCHES_IN_FLIGHT
    lease: float = LEASE
    delivery_timeout: float = DELIVERY_TIMEOUT
    poll_interval: float = POLL_INTERVAL
    notify: bool = True
    archive: bool = True
    grace: float = GRACE
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # "key": per-key order via partition ownership; "none": plain SKIP LOCKED.
    ordering: str = "key"
    # "park": a dead letter holds back its key's later events; "continue": it does not.
    on_dead: str = "park"
    ownership_lease: float = OWNERSHIP_LEASE
    name: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    # Vacuum the hot table from the relay when dead tuples pile up (see hygiene.py).
    vacuum: bool = True
    vacuum_threshold: int = DEAD_TUPLES_THRESHOLD
    # /metrics, /livez, /readyz; None: no HTTP server.
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        validate_schema(self.schema)
        if self.ordering not in ORDERINGS:
            raise ValueError(f"ordering: must be one of {ORDERINGS}, got {self.ordering!r}")
        if self.on_dead not in ON_DEAD:
            raise ValueError(f"on-dead: must be one of {ON_DEAD}, got {self.on_dead!r}")
        if not self.ownership_lease > 0:
            raise ValueError(f"ownership lease: must be > 0 seconds, got {self.ownership_lease}")
        if self.batch_size < 1:
            raise ValueError(f"batch size: must be >= 1, got {self.batch_size}")
        if self.max_batches_in_flight < 1:
            raise ValueError(f"batches in flight: must be >= 1, got {self.max_batches_in_flight}")
        if not self.poll_interval > 0:
            raise ValueError(f"poll interval: must be > 0 seconds, got {self.poll_interval}")
        if self.grace < 0:
            raise ValueError(f"grace: must be >= 0 seconds, got {self.grace}")
        # The sink must answer before PostgreSQL ends the batch's session.
        if not 0 < self.delivery_timeout < self.lease:
            raise ValueError(
                f"delivery timeout: must be > 0 and shorter than the lease ({self.lease} s), "
                f"got {self.delivery_timeout}"
            )


@dataclass
class RelayStats:
    claimed: int = 0
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    batches: int = 0
    leases_lost: int = 0


class Relay:
    """One worker: a loop over claimed batches. Call ``run()``; ``stop()`` from anywhere."""

    def __init__(self, config: RelayConfig, sink_factory: Callable[[], Sink]) -> None:
        self.config = config
        self._sink_factory = sink_factory
        self._sink: Sink | None = None
        self._secrets = secrets_of(config.dsn)
        self._stop = threading.Event()
        self._wakeup = threading.Event()
        self._idle: list[psycopg.Connection[Any]] = []
        self._in_flight: list[Batch] = []
        self._more_work = True  # claim at once on start
        self._next_poll = 0.0
        self._next_maintenance = 0.0
        self._listener: Listener | None = None
        self._hygiene: Hygiene | None = None
        self.ordered = config.ordering == "key"
        self.ownership = Ownership(
            connect=self._connect,
            schema=config.schema,
            name=config.name,
            lease=config.ownership_lease,
            batch_lease=config.lease,
            ordering=config.ordering,
        )
        self.stats = RelayStats()
        self.running = threading.Event()  # set once connected and producing
        self.metrics = RelayMetrics()
        self._health: HealthServer | None = None
        self._db_ok = False

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
                except psycopg.OperationalError:
                    # Every database call on the loop handles a lost connection
                    # itself; this is the net under a path that does not. A relay
                    # runs for months: it must not exit on a dropped connection.
                    log.exception(
                        "database connection lost on an unguarded path; releasing in-flight batches"
                    )
                    self._release_in_flight()
                    self._db_ok = False
                    self._stop.wait(1.0)
        except Exception:
            log.exception("relay loop failed; in-flight events stay pending for the next owner")
            raise
        finally:
            self.running.clear()
            self._stop.set()
            self._shutdown()

    # -- the loop ---------------------------------------------------------------

    def _step(self) -> None:
        self._finish_complete_batches()
        if self._sink is None or not self._sink.healthy():
            self._replace_sink()
        if self.ownership.due():
            self._heartbeat()
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
        elif self._in_flight:
            assert self._sink is not None
            self._sink.poll(REPORT_WAIT if slot_free else REPORT_WAIT_FULL)
        else:
            # Idle: sleep until the next poll, NOTIFY, or the next heartbeat (a long
            # poll interval must not let the ownership leases lapse).
            self._wakeup.wait(min(max(0.0, self._next_poll - now), self.ownership.seconds_until_due()))

    def _jittered_poll(self) -> float:
        # Jitter keeps many relays from polling in step.
        return self.config.poll_interval * random.uniform(0.5, 1.5)

    def _claim_and_send(self) -> int:
        assert self._sink is not None
        conn = self._connection()
        if conn is None:
            return 0
        claim_start = time.time_ns()
        try:
            if self.ordered:
                params: dict[str, Any] = {"limit": self.config.batch_size, "owner": self.ownership.id}
                rows = conn.execute(query("claim_batch", self.config.schema), params).fetchall()
            else:
                params = {"limit": self.config.batch_size}
                rows = conn.execute(query("claim_batch_unordered", self.config.schema), params).fetchall()
        except psycopg.Error as exc:
            # Connection gone, server restarting, session ended: nothing was
            # claimed that will not be claimed again.
            self._lost(conn, f"claim failed: {self._clean(exc)}")
            return 0
        self._db_ok = True  # the claim went through, empty or not
        if not rows:
            try:
                conn.rollback()
            except psycopg.Error as exc:  # the session ended between the claim and here
                self._lost(conn, f"claim failed: {self._clean(exc)}")
                return 0
            self._idle.append(conn)
            return 0
        batch = Batch(conn, rows, hold_dead=self.ordered and self.config.on_dead == "park")
        batch.spans = tracing.start_batch(batch.events, claim_start, time.time_ns())
        self.stats.claimed += len(batch)
        if self._health is not None:
            self.metrics.batch_size.observe(len(batch))
        # Per-key order: once an event of key K fails (in this batch or in one
        # still in flight), K's later events are held: left pending, untouched.
        # When the failure is committed, the claim query blocks them instead.
        held_keys = set().union(*(b.failed_keys for b in self._in_flight)) if self.ordered else set()
        for i, event in enumerate(batch.events):
            if event is None:  # corrupt row, already settled as dead
                continue
            if (
                self.ordered
                and event.key is not None
                and (event.key in held_keys or event.key in batch.failed_keys)
            ):
                batch.hold(i)
                continue
            outcome = self._sink.produce(event, partial(batch.settle, i))
            if outcome is not None:
                batch.settle(i, outcome)
        self._in_flight.append(batch)
        return len(batch)

    def _finish_complete_batches(self) -> None:
        still: list[Batch] = []
        for batch in self._in_flight:
            if not batch.complete:
                still.append(batch)
                continue
            self._finish(batch)
        self._in_flight = still

    def _finish(self, batch: Batch) -> None:
        ack_start = time.time_ns()
        try:
            done = batch.finish(
                self.config.schema,
                self.config.retry,
                archive=self.config.archive,
                park=self.ordered and self.config.on_dead == "park",
            )
        except FencingError as exc:
            tracing.end_batch(batch.spans, {}, ack_start, time.time_ns(), "lease_lost")
            self.stats.leases_lost += 1
            self.metrics.leases_lost.inc()
            log.error("%s; %d events left for their new owner", exc, len(batch))
            self._idle.append(batch.conn)
            return
        except psycopg.Error as exc:
            tracing.end_batch(batch.spans, {}, ack_start, time.time_ns(), type(exc).__name__)
            if batch.conn.closed or batch.conn.broken:
                self.stats.leases_lost += 1
                self.metrics.leases_lost.inc()
                # The lease ran out (idle_in_transaction_session_timeout ended the
                # session) or the connection broke: the ack did not commit.
                self._lost(
                    batch.conn,
                    f"ack of {len(batch)} events refused, they will be delivered again: {self._clean(exc)}",
                )
            else:  # the statement failed on a live connection: a bug or a schema change
                log.error("ack of %d events failed, they stay pending: %s", len(batch), self._clean(exc))
                batch.release()
                self._idle.append(batch.conn)
            return
        self._idle.append(batch.conn)
        if batch.spans:
            tracing.end_batch(batch.spans, _topic_errors(batch), ack_start, time.time_ns())
        if self._health is not None:
            self._record(batch, done.dead_events)
        self.stats.batches += 1
        self.stats.delivered += done.delivered
        self.stats.retried += done.retried
        self.stats.dead += done.dead
        for event_id, reason in done.dead_events:
            log.warning("event %d dead-lettered: %s", event_id, reason)
        if done.retried:
            log.info("%d events will be retried", done.retried)

    # -- connections, sink, maintenance -----------------------------------------

    def _connect(self) -> psycopg.Connection[Any]:
        lease_ms = int(self.config.lease * 1000)
        conn = psycopg.connect(
            self.config.dsn,
            autocommit=False,
            application_name="outbox-relay",
            # The lease: a transaction idle longer than this is ended by the server.
            # jit=off: the claim is a millisecond OLTP statement, and JIT compilation
            # (set off by the cost estimates of its guarded subplans) takes ~10 ms.
            options=f"-c idle_in_transaction_session_timeout={lease_ms} -c statement_timeout={lease_ms}"
            " -c jit=off",
        )
        return conn

    def _connection(self) -> psycopg.Connection[Any] | None:
        """A free connection, reconnecting with backoff; None if stopping meanwhile."""
        while self._idle:
            idle = self._idle.pop()
            if not idle.closed:
                return idle
        conn = self._reconnect()
        if conn is not None and self.ordered:
            # Register this session's pid before it can lock anything: a relay
            # taking over our partitions fences them while our sessions live.
            self._heartbeat(extra=conn)
        return conn

    def _reconnect(self) -> psycopg.Connection[Any] | None:
        """A new connection, retried with backoff; None if stopping meanwhile."""
        try:
            for attempt in Retrying(
                retry=retry_if_exception_type(psycopg.OperationalError),
                wait=wait_exponential_jitter(multiplier=0.1, max=5.0),
                stop=stop_when_event_set(self._stop),
                before_sleep=lambda rs: log.warning(
                    "cannot connect to PostgreSQL (attempt %d), retrying: %s",
                    rs.attempt_number,
                    self._clean(rs.outcome.exception()) if rs.outcome else "",
                ),
                reraise=True,
            ):
                with attempt:
                    return self._connect()
        except psycopg.OperationalError:
            return None  # stop was requested while reconnecting
        return None

    def _lost(self, conn: psycopg.Connection[Any], message: str) -> None:
        self._db_ok = False
        log.warning(message)
        with contextlib.suppress(psycopg.Error):
            conn.close()

    def _release_in_flight(self) -> None:
        for batch in self._in_flight:
            batch.release()
            self._idle.append(batch.conn)
        self._in_flight = []

    def _replace_sink(self) -> None:
        if self._sink is not None:
            log.error("sink unhealthy: releasing %d in-flight batches", len(self._in_flight))
            self._release_in_flight()
            self._sink.close(0)
        self._sink = self._sink_factory()

    def _record(self, batch: Batch, dead_events: list[tuple[int, str]]) -> None:
        """Count what a committed batch did (only when metrics are served)."""
        m = self.metrics
        now = time.time()
        dead_ids = {i for i, _ in dead_events}
        latencies: list[float] = []
        for i, (event, outcome) in enumerate(zip(batch.events, batch.outcomes, strict=True)):
            if outcome is None:
                continue
            topic = event.topic if event is not None else "(corrupt)"
            if isinstance(outcome, Delivered):
                m.delivered.inc((topic,))
                if event is not None:
                    latencies.append(now - event.created_at.timestamp())
                continue
            m.errors.inc((topic, error_type(outcome.reason)))
            if isinstance(outcome, Dead) or batch.ids[i] in dead_ids:
                m.dead.inc((topic,))
        m.latency.observe_many(latencies)

    def ready(self) -> tuple[bool, str]:
        """For /readyz: database reachable, sink healthy, not shutting down."""
        if self._stop.is_set():
            return False, "draining: shutting down"
        if not self.running.is_set():
            return False, "starting"
        if self._sink is None or not self._sink.healthy():
            return False, "sink unhealthy"
        if not self._db_ok:
            return False, "database unreachable"
        return True, "ready"

    def _heartbeat(self, extra: psycopg.Connection[Any] | None = None) -> None:
        conns = [*self._idle, *(b.conn for b in self._in_flight), *([extra] if extra else [])]
        pids = [c.info.backend_pid for c in conns if not c.closed]
        if self.ownership.tick(pids, (id(b) for b in self._in_flight)):
            self._wakeup.set()  # new partitions: there may be work right now
        self.metrics.owned_partitions.set(len(self.ownership.owned))

    def _maintain_partitions(self) -> None:
        self._next_maintenance = time.monotonic() + PARTITION_MAINTENANCE
        conn = self._connection()
        if conn is None:
            return
        try:
            conn.execute(query("ensure_partitions", self.config.schema))
            conn.commit()
            self._idle.append(conn)
        except psycopg.OperationalError as exc:
            self._lost(conn, f"archive partition maintenance failed: {self._clean(exc)}")
            self._next_maintenance = time.monotonic() + 10.0
        except psycopg.Error as exc:
            log.error("archive partition maintenance failed: %s", self._clean(exc))
            try:
                conn.rollback()
            except psycopg.Error:
                self._lost(conn, "archive partition maintenance: connection lost")
                return
            self._idle.append(conn)

    def _clean(self, exc: BaseException | None) -> str:
        return scrub(str(exc), self._secrets)

    # -- start and stop ---------------------------------------------------------

    def _start(self) -> None:
        if self.config.metrics_port is not None:
            gauges = DatabaseGauges(self.config.dsn, self.config.schema, self.metrics)
            self._health = HealthServer(
                self.config.metrics_host, self.config.metrics_port, self.metrics, gauges, self.ready
            ).start()
            log.info(
                "serving /metrics, /livez, /readyz on %s:%d", self.config.metrics_host, self._health.port
            )
        self._sink = self._sink_factory()
        self._heartbeat()  # join and take a share of the partitions before the first claim
        if self.config.vacuum:
            self._hygiene = Hygiene(
                self.config.dsn, self.config.schema, self._stop, threshold=self.config.vacuum_threshold
            )
            self._hygiene.start()
        if self.config.notify:
            self._listener = Listener(
                self.config.dsn, channel_name(self.config.schema), self._wakeup, self._stop
            )
            self._listener.start()
        log.info(
            "relay %s started: schema=%s ordering=%s on-dead=%s batch=%d in-flight batches=%d "
            "lease=%ss notify=%s",
            self.ownership.id,
            self.config.schema,
            self.config.ordering,
            self.config.on_dead,
            self.config.batch_size,
            self.config.max_batches_in_flight,
            self.config.lease,
            self.config.notify,
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
            for batch in self._in_flight:
                batch.release()
                self._idle.append(batch.conn)
            self._in_flight = []
        if self._sink is not None:
            self._sink.close(max(0.0, min(1.0, deadline - time.monotonic())))
            self._sink = None
        # No batch holds locks any more: hand the partitions over at once.
        self.ownership.release_all()
        for conn in self._idle:
            with contextlib.suppress(psycopg.Error):
                conn.close()
        self._idle = []
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


def _topic_errors(batch: Batch) -> dict[str, str]:
    """The first failure's error type per topic of a finished batch (for its spans)."""
    errors: dict[str, str] = {}
    for event, outcome in zip(batch.events, batch.outcomes, strict=True):
        if event is not None and outcome is not None and not isinstance(outcome, Delivered):
            errors.setdefault(event.topic, error_type(outcome.reason))
    return errors
