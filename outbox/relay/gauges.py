"""Queue and table gauges (pending, oldest age, dead tuples, table size, oldest snapshot, the WAL
slot's lag) read from PostgreSQL at scrape time, at most once per ``DB_GAUGE_TTL``, so that they
are true whichever relay processes are running."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from outbox import capture
from outbox.observe.conditions import Condition
from outbox.observe.prometheus import Labels
from outbox.relay.limits import Limit
from outbox.relay.metrics import RelayMetrics
from outbox.store import pinning
from outbox.store.dsn import scrub, secrets_of
from outbox.store.queries import query

if TYPE_CHECKING:
    from outbox.store.outboxes import Outbox

log = logging.getLogger("outbox.metrics")

DB_GAUGE_TTL = 2.0  # seconds a scrape may reuse the previous database reading


class DatabaseGauges:
    """Reads the queue and table gauges of a database's outboxes from PostgreSQL, at most once
    per TTL (one connection, one reading of each outbox)."""

    def __init__(
        self,
        dsn: str,
        outboxes: Callable[[], list[Outbox]],
        metrics: RelayMetrics,
        limits: Sequence[Limit] = (),
    ) -> None:
        self._dsn = dsn
        self._limits = list(limits)
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
                with pinning.connect(
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
        if self._limits:  # each topic's events wait on the first limit that matches it
            waiting: dict[Labels, float] = {(name, limit.glob): 0.0 for limit in self._limits}
            for topic, n, _ in rows:
                limit = next((lim for lim in self._limits if lim.matches(topic)), None)
                if limit is not None:
                    waiting[(name, limit.glob)] += float(n)
            m.limit_waiting.replace_where(0, name, waiting)
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
