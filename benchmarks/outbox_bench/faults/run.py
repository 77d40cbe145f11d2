"""One scenario's run: its schema and topic, load, relays and observers, and its accounting."""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox import capture
from outbox.harness.embedded import Broker, free_port
from outbox.harness.infra import create_topic
from outbox.harness.load import LoadProcess, Written, prepare
from outbox.harness.tap import Tap
from outbox.observe.progress import Progress
from outbox.store.migrate import migrate
from outbox_bench.faults.config import FaultConfig
from outbox_bench.faults.relays import Relays, poll_until
from outbox_bench.faults.tally import tally
from outbox_bench.harness.proxy import Proxy
from outbox_bench.harness.sinktaps import SinkTap
from outbox_bench.harness.taps import open_tap
from outbox_bench.queries import query

MiB = 1 << 20
TOPIC_PARTITIONS = 3
SWEEP_EVERY = 10.0  # seconds between re-reads of the topic while draining with a fetch gap
WRITERS_START = 60.0  # seconds the app's process may take to commit its first event
WINDOW_PATIENCE = 5.0  # a load window waits at most this many times its seconds for its commits
WINDOW_GRACE = 15.0  # ... and at least this many seconds more


class Window:
    """A stretch of load (a warmup, a fault, a tail): its seconds, then on until the app has
    committed ``cfg.window_commits`` in it. Beside a loaded suite the app can fall far behind its
    rate (CI: 73 commits in 11 s at 150/s, each 0.3 s), and a fault that met a few writes proves
    little. It waits at most WINDOW_PATIENCE times its seconds (WINDOW_GRACE more at least); a
    window that ends short of its commits is recorded in ``run.short_windows``, and the run's
    fault then counts as not provoked."""

    def __init__(
        self, run: Run, name: str, seconds: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.run, self.name, self.seconds, self.clock = run, name, seconds, clock
        self.since = run.writers.count
        self.start = clock()
        self.end = self.start + seconds
        self.limit = self.start + max(seconds * WINDOW_PATIENCE, seconds + WINDOW_GRACE)
        self.held = False  # kept open past its seconds for its commits

    def committed(self) -> int:
        return self.run.writers.count - self.since

    def open(self) -> bool:
        now = self.clock()
        if now < self.end:
            return True
        short = self.committed() < self.run.cfg.window_commits
        self.held = self.held or short
        return short and now < self.limit and self.run.writers.alive()

    def left(self) -> float:
        """Seconds to the window's planned end (after it: how often to look at the commits)."""
        return max(self.end - self.clock(), 0.1)

    def close(self) -> None:
        took, n = self.clock() - self.start, self.committed()
        if n < self.run.cfg.window_commits:
            self.run.short_windows.append(f"{self.name}: {n} commits in {took:.1f} s")
        elif self.held:
            self.run.mark(f"{self.name} held {took - self.seconds:.1f} s longer, for {n} commits")


class Monitor(threading.Thread):
    """Samples the hot table every half second: pending rows, heap and total size."""

    def __init__(self, dsn: str, schema: str) -> None:
        super().__init__(name="faults-monitor", daemon=True)
        self.dsn, self.schema = dsn, schema
        self.samples: list[tuple[float, int, int, int]] = []  # (time, pending, heap bytes, total bytes)
        self.stop_event = threading.Event()

    def run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        sample = query("harness_table_size", self.schema)
        while not self.stop_event.wait(0.5):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=3)
                row = conn.execute(sample, {"schema": self.schema}).fetchone()
                if row is not None:
                    self.samples.append((time.time(), int(row[0]), int(row[1]), int(row[2])))
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()


class Run:
    """One scenario: load, relays and observers on a schema and topic of its own."""

    def __init__(
        self, cfg: FaultConfig, name: str, extra: list[str] | None = None, env: dict[str, str] | None = None
    ) -> None:
        self.cfg, self.name = cfg, name
        tag = uuid.uuid4().hex[:8]
        self.schema = f"faults_{name.replace('-', '_')}_{tag}"
        self.topic = f"faults.{name}.{tag}"
        self.writers = LoadProcess(
            cfg.dsn, self.schema, self.topic, rate=cfg.rate, writers=cfg.writers, keys=cfg.keys
        )
        # Against a sink other than Kafka (--sink), the relays reach it through a proxy
        # that the sink-outage scenario takes away.
        self.proxy: Proxy | None = None
        self.tap: Tap | SinkTap
        route = None
        # Kafka's blackhole needs a broker that tells its clients a proxy's port (or they would
        # connect straight to it after the first metadata answer): a broker of this run's own.
        self.broker: Broker | None = None
        self.bootstrap = cfg.bootstrap
        if cfg.sink:
            self.tap = open_tap(cfg.sink, self.topic)
            self.proxy = Proxy(*self.tap.server)
            route = f"*={self.tap.route('127.0.0.1', self.proxy.port)}"
        else:
            if name == "blackhole-sink":
                broker_port = free_port()
                self.proxy = Proxy("127.0.0.1", broker_port)
                self.broker = Broker(broker_port, advertised_port=self.proxy.port)
                self.bootstrap = self.broker.bootstrap
                route = f"*=kafka://{self.bootstrap}"
            self.tap = Tap(self.bootstrap, self.topic)
        self.monitor = Monitor(cfg.dsn, self.schema)
        # The blackhole-pg scenario puts a proxy between the relays and PostgreSQL (only them:
        # the writers, the monitor and the accounting keep their direct connections).
        self.pg_proxy: Proxy | None = None
        relay_dsn = None
        if name == "blackhole-pg":
            target = conninfo_to_dict(cfg.dsn)
            host, port = str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432)
            # The embedded server listens on a socket directory: the proxy forwards to its socket.
            unix = f"{host}/.s.PGSQL.{port}" if host.startswith("/") else None
            self.pg_proxy = Proxy(host, port, unix_path=unix)
            relay_dsn = make_conninfo(cfg.dsn, host="127.0.0.1", port=str(self.pg_proxy.port))
        self.relays = Relays(cfg, self.schema, name, extra or [], env or {}, route=route, dsn=relay_dsn)
        self.events: list[tuple[float, str]] = []  # (time, what was done)
        self.fault_end: float | None = None
        self.expected_dead: list[Written] = []
        self.notes: dict[str, Any] = {}
        self.short_windows: list[str] = []  # load windows that ended short of their commits
        self.started = 0.0

    def mark(self, what: str) -> None:
        self.events.append((time.time(), what))

    def setup(self) -> None:
        with psycopg.connect(self.cfg.dsn, autocommit=True) as conn:
            migrate(conn, self.schema)
            if self.cfg.capture != "table":
                capture.switch(conn, self.schema, self.cfg.capture)
        prepare(self.cfg.dsn, self.schema)
        if self.pg_proxy is not None:
            self.pg_proxy.start()
        if isinstance(self.tap, SinkTap):
            self.tap.setup()
            assert self.proxy is not None
            self.proxy.start()
            return
        if self.broker is not None:
            self.broker.start()
            assert self.proxy is not None
            self.proxy.start()
        create_topic(self.bootstrap, self.topic, TOPIC_PARTITIONS)

    def teardown(self) -> None:
        with psycopg.connect(self.cfg.dsn, autocommit=True) as conn:
            conn.execute(query("harness_drop_schema", self.schema))
        if isinstance(self.tap, SinkTap):
            self.tap.teardown()

    def close(self) -> None:
        """Release what outlives a failed run too (the proxies, a broker of its own, a webhook receiver,
        a replication slot: it would keep the server's WAL; a failed run's schema stays)."""
        if self.cfg.capture != "table":
            with contextlib.suppress(psycopg.Error), psycopg.connect(self.cfg.dsn, autocommit=True) as conn:
                capture.switch(conn, self.schema, "table", drop_slot=True)
        if self.proxy is not None:
            self.proxy.stop()
        if self.broker is not None:
            self.broker.stop()
        if self.pg_proxy is not None:
            self.pg_proxy.stop()
        if isinstance(self.tap, SinkTap) and self.tap.scheme == "http":
            self.tap.teardown()

    def sleep(self, seconds: float, progress: Progress | None = None, window: str = "") -> None:
        """Let the load run for ``seconds``, redrawing the progress line; given a ``window``
        name, on until the window has its commits (:class:`Window`)."""
        if window:
            w = Window(self, window, seconds)
            while w.open():
                self._pause(w.left(), progress)
            w.close()
            return
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self._pause(left, progress)

    def window(self, name: str, seconds: float) -> Window:
        """A load window a scenario's own loop runs in (``while w.open()``, then ``w.close()``)."""
        return Window(self, name, seconds)

    def _pause(self, seconds: float, progress: Progress | None) -> None:
        time.sleep(min(0.5, seconds))
        if progress is not None:
            progress.update(time.time() - self.started, self.status())

    def status(self) -> str:
        return f"committed {self.writers.count:,} seen {self.tap.count():,}"

    @contextlib.contextmanager
    def load(self) -> Iterator[None]:
        """Relays started and ready, observers on, then the writers; the writers stop at the end."""
        self.setup()
        self.tap.start()
        self.monitor.start()
        for i in range(self.cfg.relays):
            self.relays.start(i)
        for i in range(self.cfg.relays):
            self.relays.wait_ready(i)  # the fault must hit relays that are really working
        self.writers.start()
        # The scenario's clock starts with the first commit: the app's process took 10 s to write
        # its first event on a loaded CI machine, and a 4 s sink outage (or a late-ack window)
        # over before it began provoked nothing.
        poll_until(lambda: self.writers.count > 0 or not self.writers.alive(), WRITERS_START, interval=0.05)
        self.started = time.time()
        try:
            yield
        finally:
            self.writers.stop()
            self.mark("writers stopped")

    def drain(self) -> bool:
        """Wait until every committed event was seen or dead-lettered and the outbox is empty."""
        expected_dead = {w.event_id for w in self.expected_dead}
        swept = [0.0]

        def drained() -> bool:
            with self.tap.lock:
                seen = set(self.tap.first_seen)
            missing = [
                w
                for w in self.writers.committed
                if w.event_id not in seen and w.event_id not in expected_dead
            ]
            pending = self._pending()
            if not missing and pending == 0:
                return True
            may_skip = self.tap.gaps or getattr(self.tap, "may_skip", False)
            if missing and may_skip and pending == 0 and time.monotonic() - swept[0] > SWEEP_EVERY:
                swept[0] = time.monotonic()
                self.tap.sweep()  # the live consumer had skipped records the broker holds
            return False

        return poll_until(drained, self.cfg.drain_timeout, interval=0.5)

    def _pending(self) -> int:
        try:
            with psycopg.connect(self.cfg.dsn, connect_timeout=3) as conn:
                row = conn.execute(query("harness_pending_count", self.schema)).fetchone()
                return int(row[0]) if row else -1
        except psycopg.Error:
            return -1

    def account(self, drained: bool) -> dict[str, Any]:
        self.tap.stop_event.set()
        self.monitor.stop_event.set()
        exit_codes = self.relays.stop_all()
        self.tap.join(10)
        self.monitor.join(10)
        # The live read can miss a record the broker had (Tansu's memory engine has
        # shown one such fetch gap in 40k): read the topic once more before counting.
        self.tap.sweep()
        self.notes["found_by_sweep"] = self.tap.found_by_reread
        self.notes["consumer_gaps"] = self.tap.gaps
        with psycopg.connect(self.cfg.dsn) as conn:
            archived_rows = conn.execute(query("harness_archived_ids", self.schema)).fetchall()
            dead_rows = conn.execute(query("harness_dead_ids", self.schema)).fetchall()
            pending_ids = {r[0] for r in conn.execute(query("harness_pending_ids", self.schema)).fetchall()}
        with self.tap.lock:
            seen = list(self.tap.seen)
        result: dict[str, Any] = tally(
            committed=self.writers.committed,
            unsure=self.writers.unsure,
            expected_dead=self.expected_dead,
            seen=seen,
            archived={eid: int(n) for eid, n in archived_rows},
            dead={eid: int(a) for eid, a in dead_rows},
            pending=pending_ids,
            fault_end=self.fault_end,
        )
        samples = self.monitor.samples
        result.update(
            {
                "writer_errors": self.writers.errors,
                "writer_last_error": self.writers.last_error,
                "writer_crashed": self.writers.crashed,
                "slowest_commit_s": round(self.writers.slowest_commit, 3),
                "short_windows": self.short_windows,
                "drained": drained,
                "relay_starts": self.relays.starts,
                "relay_exit_codes": exit_codes,
                "seconds": round(time.time() - self.started, 1),
                "timeline": [(round(t - self.started, 2), what) for t, what in self.events],
                "table_peak_mib": round(max((s[3] for s in samples), default=0) / MiB, 2),
                "table_end_mib": round(samples[-1][3] / MiB, 2) if samples else None,
                "heap_end_mib": round(samples[-1][2] / MiB, 3) if samples else None,
                "relay_logs": [str(p) for p in self.relays.logs],
                **self.relays.events(),
                **self.notes,
            }
        )
        return result

    def throughput(self, start: float, end: float) -> float:
        """Events first seen per second in [start, end)."""
        with self.tap.lock:
            n = sum(1 for t in self.tap.first_seen.values() if start <= t < end)
        return n / max(end - start, 1e-9)
