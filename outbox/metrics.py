"""Prometheus metrics and health endpoints of the relay.

``/metrics`` serves the Prometheus text format; ``/livez`` says the process is
alive; ``/readyz`` says the relay can do its job (database reachable, sink
healthy, not draining for shutdown). Counters and histograms are updated by the
relay as batches finish. Queue and table gauges (pending, oldest age, dead
tuples, table size, oldest snapshot) are read from PostgreSQL at scrape time,
at most once per ``DB_GAUGE_TTL``, so that they are true whichever relay
processes are running.

A small dependency-free registry: the relay needs a handful of metric kinds,
and a sidecar should not pull in a web framework.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import psycopg

from outbox import capture
from outbox.conditions import Condition
from outbox.dsn import scrub, secrets_of
from outbox.queries import query

if TYPE_CHECKING:
    from outbox.health import Readiness
    from outbox.outboxes import Outbox

log = logging.getLogger("outbox.metrics")

DB_GAUGE_TTL = 2.0  # seconds a scrape may reuse the previous database reading
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)  # seconds
BATCH_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2500, 5000)  # events

Labels = tuple[str, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt_labels(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(v: float) -> str:
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if not float(v).is_integer() else str(int(v))


class _Metric:
    kind = ""

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labels = tuple(labels)
        self._lock = threading.Lock()

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(_Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[Labels, float] = {}

    def inc(self, labels: Labels = (), amount: float = 1.0) -> None:
        with self._lock:
            self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, labels: Labels = ()) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        if not items and not self.labels:
            items = [((), 0.0)]  # an unlabelled counter exists from the start: 0, not absent
        return self.header() + [f"{self.name}{_fmt_labels(self.labels, k)} {_num(v)}" for k, v in items]


class Gauge(_Metric):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labels)
        self._values: dict[Labels, float] = {}

    def set(self, value: float, labels: Labels = ()) -> None:
        with self._lock:
            self._values[labels] = value

    def replace(self, values: dict[Labels, float]) -> None:
        """Set every series at once (series absent from ``values`` disappear)."""
        with self._lock:
            self._values = dict(values)

    def replace_where(self, position: int, value: str, values: dict[Labels, float]) -> None:
        """Set every series whose label at ``position`` is ``value`` (those absent from ``values``
        disappear); the other series stay: one outbox's topics, say."""
        with self._lock:
            kept = {k: v for k, v in self._values.items() if k[position] != value}
            self._values = {**kept, **values}

    def forget(self, position: int, value: str) -> None:
        """Drop every series whose label at ``position`` is ``value`` (an outbox no longer served)."""
        with self._lock:
            self._values = {k: v for k, v in self._values.items() if k[position] != value}

    def render(self) -> list[str]:
        with self._lock:
            items = sorted(self._values.items())
        return self.header() + [f"{self.name}{_fmt_labels(self.labels, k)} {_num(v)}" for k, v in items]


class Histogram(_Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help_text, labels)
        self.buckets = tuple(sorted(buckets))
        # labels -> [count per bucket (+Inf last), sum, count]
        self._series: dict[Labels, tuple[list[int], list[float]]] = {}

    def observe_many(self, values: Iterable[float], labels: Labels = ()) -> None:
        with self._lock:
            series = self._series.get(labels)
            if series is None:
                series = self._series[labels] = ([0] * (len(self.buckets) + 1), [0.0, 0.0])
            counts, totals = series
            for v in values:
                counts[bisect.bisect_left(self.buckets, v)] += 1
                totals[0] += v
                totals[1] += 1

    def observe(self, value: float, labels: Labels = ()) -> None:
        self.observe_many((value,), labels)

    @property
    def count(self) -> int:
        return int(sum(totals[1] for _, totals in self._series.values()))

    def render(self) -> list[str]:
        with self._lock:
            items = sorted((k, (list(c), list(t))) for k, (c, t) in self._series.items())
        if not items and not self.labels:
            items = [((), ([0] * (len(self.buckets) + 1), [0.0, 0.0]))]
        lines = self.header()
        for labels, (counts, (total, n)) in items:
            cumulative = 0
            for bound, c in zip(self.buckets, counts, strict=False):
                cumulative += c
                le = f'le="{_num(bound)}"'
                lines.append(f"{self.name}_bucket{_fmt_labels(self.labels, labels, le)} {cumulative}")
            inf = 'le="+Inf"'
            lines.append(f"{self.name}_bucket{_fmt_labels(self.labels, labels, inf)} {int(n)}")
            lines.append(f"{self.name}_sum{_fmt_labels(self.labels, labels)} {_num(total)}")
            lines.append(f"{self.name}_count{_fmt_labels(self.labels, labels)} {int(n)}")
        return lines


class RelayMetrics:
    """Every metric the relay exports."""

    def __init__(self) -> None:
        self.delivered = Counter(
            "outbox_events_delivered_total",
            "Events acknowledged by the sink and archived.",
            ["outbox", "topic", "sink"],
        )
        self.errors = Counter(
            "outbox_delivery_errors_total",
            "Failed delivery attempts, by the kind of error the sink reported.",
            ["outbox", "topic", "sink", "error_type"],
        )
        self.dead = Counter(
            "outbox_events_dead_total", "Events moved to dead letters.", ["outbox", "topic", "sink"]
        )
        self.latency = Histogram(
            "outbox_delivery_latency_seconds",
            "Event creation to broker acknowledgement.",
            LATENCY_BUCKETS,
            ["outbox"],
        )
        self.batch_size = Histogram(
            "outbox_batch_size", "Events per claimed batch.", BATCH_BUCKETS, ["outbox"]
        )
        self.leases_lost = Counter(
            "outbox_leases_lost_total", "Batches whose ack was refused because the lease ended.", ["outbox"]
        )
        self.sinks_replaced = Counter(
            "outbox_sink_replacements_total", "Sinks found unhealthy (fatal or stuck) and created anew."
        )
        self.partitions_lost = Counter(
            "outbox_partitions_lost_total", "Owned key partitions found taken by another relay.", ["outbox"]
        )
        self.pending = Gauge("outbox_pending_events", "Events waiting in the outbox.", ["outbox", "topic"])
        self.oldest_age = Gauge(
            "outbox_oldest_pending_age_seconds", "Age of the oldest event waiting in the outbox.", ["outbox"]
        )
        self.dead_tuples = Gauge(
            "outbox_table_dead_tuples", "Dead tuples in the hot events table (vacuum backlog).", ["outbox"]
        )
        self.table_bytes = Gauge(
            "outbox_table_bytes", "Size of the hot events table with its indexes.", ["outbox"]
        )
        self.oldest_xmin = Gauge(
            "outbox_oldest_xmin_age_seconds",
            "Age of the oldest open snapshot in the outbox's database: it stops vacuum from cleaning "
            "the table.",
            ["outbox"],
        )
        self.owned_partitions = Gauge(
            "outbox_owned_partitions", "Key partitions this relay owns (ordered mode).", ["outbox"]
        )
        self.up = Gauge(
            "outbox_database_up", "1 if the last reading of the outbox's tables succeeded.", ["outbox"]
        )
        self.wal_lag_bytes = Gauge(
            "outbox_wal_slot_lag_bytes",
            "WAL capture: WAL the outbox's slot keeps that is not confirmed yet, in bytes.",
            ["outbox"],
        )
        self.wal_lag_seconds = Gauge(
            "outbox_wal_slot_lag_seconds",
            "WAL capture: how long the slot's confirmed position has not moved while WAL was "
            "written after it (0 when it is caught up).",
            ["outbox"],
        )
        self.wal_active = Gauge(
            "outbox_wal_slot_active",
            "WAL capture: 1 if a relay streams the outbox's slot, else 0.",
            ["outbox"],
        )
        self.ready = Gauge("outbox_ready", "1 if /readyz answers 200 (the relay can make progress), else 0.")
        self.not_ready_seconds = Gauge(
            "outbox_not_ready_seconds", "How long the relay has not been ready, in seconds (0 when ready)."
        )
        self.not_ready = Gauge(
            "outbox_not_ready",
            "1 for why the relay is not ready: database, sink, stalled or lifecycle.",
            ["reason"],
        )
        self._not_ready_since = 0.0
        self._all: list[_Metric] = [
            self.delivered, self.errors, self.dead, self.latency, self.batch_size, self.leases_lost,
            self.sinks_replaced, self.partitions_lost, self.pending, self.oldest_age, self.dead_tuples,
            self.table_bytes, self.oldest_xmin, self.owned_partitions, self.up, self.ready,
            self.not_ready_seconds, self.not_ready, self.wal_lag_bytes, self.wal_lag_seconds, self.wal_active,
        ]  # fmt: skip

    def note_readiness(self, readiness: Readiness) -> None:
        """Readiness as metrics (each /readyz or /metrics request computes it)."""
        now = time.monotonic()
        if readiness.ok:
            self._not_ready_since = 0.0
            self.ready.set(1)
            self.not_ready_seconds.set(0)
            self.not_ready.replace({})
            return
        if not self._not_ready_since:
            self._not_ready_since = now
        self.ready.set(0)
        self.not_ready_seconds.set(round(now - self._not_ready_since, 1))
        self.not_ready.replace({(readiness.reason,): 1})

    def render(self) -> str:
        lines: list[str] = []
        for m in self._all:
            lines.extend(m.render())
        return "\n".join(lines) + "\n"


class DatabaseGauges:
    """Reads the queue and table gauges of a database's outboxes from PostgreSQL, at most once
    per TTL (one connection, one reading of each outbox)."""

    def __init__(self, dsn: str, outboxes: Callable[[], list[Outbox]], metrics: RelayMetrics) -> None:
        self._dsn = dsn
        self._outboxes = outboxes
        self._metrics = metrics
        self._lock = threading.Lock()
        self._read_at = 0.0
        self.ok = False
        self.condition = Condition(log, "metrics_database", "metrics: cannot read the database")
        self._slot_moves: dict[str, tuple[str, float]] = {}  # outbox -> (confirmed position, since)

    def refresh(self) -> bool:
        with self._lock:
            if time.monotonic() - self._read_at < DB_GAUGE_TTL:
                return self.ok
            self._read_at = time.monotonic()
            m = self._metrics
            outboxes = self._outboxes()
            up: dict[Labels, float] = {(o.name,): 0.0 for o in outboxes}
            try:
                with psycopg.connect(
                    self._dsn,
                    autocommit=True,
                    connect_timeout=3,
                    application_name="outbox-metrics",
                ) as conn:
                    conn.execute(query("metrics_session", "public"))
                    xmin = conn.execute(query("oldest_xmin_age", "public")).fetchone()
                    oldest_xmin = float(xmin[0]) if xmin and xmin[0] is not None else 0.0
                    for o in outboxes:
                        try:
                            self._read(conn, o.name, o.schema, oldest_xmin)
                        except psycopg.OperationalError:
                            raise
                        except (
                            psycopg.Error
                        ):  # this outbox's tables (dropped, not migrated): the others go on
                            continue
                        up[(o.name,)] = 1.0
                self.ok = True
                self.condition.ok()
            except psycopg.Error as exc:
                self.condition.fail(scrub(str(exc), secrets_of(self._dsn)))
                self.ok = False
            for labels, value in up.items():
                m.up.set(value, labels)
            return self.ok

    def _read(self, conn: psycopg.Connection[Any], name: str, schema: str, oldest_xmin: float) -> None:
        m = self._metrics
        rows = conn.execute(query("status_by_topic", schema)).fetchall()
        m.pending.replace_where(0, name, {(name, t): float(n) for t, n, _ in rows})
        m.oldest_age.set(max((float(a) for _, _, a in rows), default=0.0), (name,))
        dead, _live, size = conn.execute(query("hot_table_stats", schema), {"schema": schema}).fetchone() or (
            0,
            0,
            0,
        )
        m.dead_tuples.set(float(dead), (name,))
        m.table_bytes.set(float(size), (name,))
        m.oldest_xmin.set(oldest_xmin, (name,))
        slot = capture.state(conn, schema).slot
        lag = conn.execute(query("slot_lag", schema), {"slot": slot}).fetchone() if slot else None
        if lag is None:
            return
        active, behind, confirmed = lag
        moved = self._slot_moves.get(name)
        now = time.monotonic()
        if moved is None or moved[0] != confirmed:
            moved = self._slot_moves[name] = (confirmed, now)
        m.wal_active.set(1.0 if active else 0.0, (name,))
        m.wal_lag_bytes.set(float(behind or 0), (name,))
        m.wal_lag_seconds.set(now - moved[1] if behind else 0.0, (name,))


class HealthServer:
    """``/metrics``, ``/livez``, ``/readyz`` on ``host:port`` in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: RelayMetrics,
        gauges: Sequence[DatabaseGauges] | Callable[[], Sequence[DatabaseGauges]],
        ready: Callable[[], Readiness],
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    for each in gauges() if callable(gauges) else gauges:
                        each.refresh()
                    metrics.note_readiness(outer._ready())
                    self._send(200, metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
                elif path == "/livez":
                    self._send(200, "ok\n")
                elif path == "/readyz":
                    readiness = outer._ready()
                    metrics.note_readiness(readiness)
                    self._send(200 if readiness.ok else 503, readiness.text() + "\n")
                else:
                    self._send(404, "not found\n")

            def _send(self, code: int, body: str, ctype: str = "text/plain; charset=utf-8") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return  # scrapes every few seconds are not news

        self._ready = ready
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="outbox-http", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
