"""The relay's Prometheus metrics: counters and histograms updated as batches finish, and the
gauges a scrape reads (queue and tables: :mod:`outbox.relay.gauges`; readiness: :mod:`outbox.relay.health`).
They are served by :class:`outbox.relay.endpoints.HealthServer` on ``/metrics``."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from outbox.observe.prometheus import Counter, Gauge, Histogram, Metric

if TYPE_CHECKING:
    from outbox.observe.readiness import Readiness

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)  # seconds
BATCH_BUCKETS = (1, 10, 50, 100, 250, 500, 1000, 2500, 5000)  # events


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
        self.expired = Counter(
            "outbox_expired_total",
            "Events claimed at or after their expires_at: dead-lettered (kind expired), not sent.",
            ["outbox", "topic"],
        )
        self.filtered = Counter(
            "outbox_events_filtered_total",
            "Events a transform (--transform) dropped: archived as filtered, not sent.",
            ["outbox", "topic", "transform"],
        )
        self.latency = Histogram(
            "outbox_delivery_latency_seconds",
            "Commit (since=commit: WAL capture, or track_commit_timestamp on) or creation "
            "(since=created: a retry, or the commit time not kept) to broker acknowledgement.",
            LATENCY_BUCKETS,
            ["outbox", "since"],
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
        self.key_order_violations = Counter(
            "outbox_key_order_violations_total",
            "Events delivered ahead of an earlier event of their key that is to be retried.",
            ["outbox"],
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
        self.limit_throttled = Counter(
            "outbox_limit_throttled_seconds_total",
            "Seconds an outbox's events of a limit (--limit) waited for its tokens or in-flight cap.",
            ["outbox", "limit"],
        )
        self.limit_waiting = Gauge(
            "outbox_limit_waiting_events",
            "Events of a limit (--limit) waiting in the outbox (read at scrape time).",
            ["outbox", "limit"],
        )
        self.sink_missing = Gauge(
            "outbox_sink_missing_events",
            "Delivered events the last verification (--verify-every) found missing from their sink "
            "(a broker lost acknowledged writes); 0 where none is.",
            ["outbox", "topic", "sink"],
        )
        self.verify_checked = Counter(
            "outbox_verify_checked_total",
            "Delivered events read back from their sinks by the relay's verifications.",
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
        self._all: list[Metric] = [
            self.delivered, self.errors, self.dead, self.expired, self.filtered, self.latency,
            self.batch_size, self.leases_lost, self.sinks_replaced, self.partitions_lost,
            self.key_order_violations, self.pending,
            self.oldest_age, self.dead_tuples, self.table_bytes, self.oldest_xmin, self.owned_partitions,
            self.up, self.ready,
            self.not_ready_seconds, self.not_ready, self.wal_lag_bytes, self.wal_lag_seconds, self.wal_active,
            self.limit_throttled, self.limit_waiting, self.sink_missing, self.verify_checked,
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
