"""Hot-table hygiene: keep ``events`` small even where autovacuum is off or lags.

Every row of ``events`` is deleted within milliseconds of its insert, so the
table is all dead tuples unless something vacuums it. The migration tunes
autovacuum for it, but autovacuum may be switched off (it is on some CI and
test servers), starved of workers, or slowed by cost limits; then the claim
scans ever more dead index entries and throughput sags (seen in the soak).

So the relay looks after its own table: a side thread reads the table's
statistics every few seconds and runs ``VACUUM (ANALYZE)`` when dead tuples
pile up and outnumber the live ones, or when the table is drained but still
large (so VACUUM can truncate it back to near zero). One relay at a time does it (advisory lock). When a
vacuum cannot remove the dead tuples, the usual cause is a snapshot held open
elsewhere; the relay says so, with the age of the oldest one, and backs off.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time

import psycopg

from outbox.conditions import Condition
from outbox.dsn import scrub, secrets_of
from outbox.queries import query

log = logging.getLogger("outbox.hygiene")

CHECK_INTERVAL = 5.0  # seconds between looks at the table's statistics
DEAD_TUPLES_THRESHOLD = 20_000  # vacuum once this many dead tuples have piled up
DRAINED_BYTES = 1 << 20  # bytes; a drained table larger than this is vacuumed to truncate it
DRAINED_LIVE = 1000  # live tuples (estimated) under which the table counts as drained
MAX_BACKOFF = 300.0  # seconds; longest pause after vacuums that could not clean up


class Hygiene(threading.Thread):
    """Vacuums ``<schema>.events`` when needed, until ``stop`` is set."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        stop: threading.Event,
        *,
        threshold: int = DEAD_TUPLES_THRESHOLD,
        interval: float = CHECK_INTERVAL,
    ) -> None:
        super().__init__(name="outbox-hygiene", daemon=True)
        self._dsn = dsn
        self._schema = schema
        self._stop_event = stop
        self._threshold = threshold
        self._interval = interval
        self._lock_key = int.from_bytes(
            hashlib.sha256(f"outbox-hygiene:{schema}".encode()).digest()[:8], "big", signed=True
        )
        self.vacuums = 0
        self.allowed: bool | None = None  # may this role VACUUM the table? Learnt on the first check.
        self.condition = Condition(log, "hygiene", "hot-table check failing")

    def run(self) -> None:
        wait = self._interval
        while not self._stop_event.wait(wait):
            try:
                with psycopg.connect(self._dsn, autocommit=True, application_name="outbox-hygiene") as conn:
                    wait = self.check(conn)
                self.condition.ok()
            except psycopg.Error as exc:
                self.condition.fail(scrub(str(exc), secrets_of(self._dsn)))
                wait = self._interval

    def needs_vacuum(self, dead: int, live: int, size: int) -> bool:
        """Vacuum when dead tuples dominate the table, or a drained table is still large.

        Not while a large backlog is being drained (dead < live): VACUUM would scan the
        whole table to reclaim a minority of it, taking CPU from the drain itself.
        """
        if dead >= self._threshold and dead >= live:
            return True
        # Drained (or nearly: n_live_tup is an estimate that drifts) but still large:
        # a vacuum now frees every page and truncates the file.
        return dead > 0 and live < DRAINED_LIVE and size > DRAINED_BYTES

    def _may_vacuum(self, conn: psycopg.Connection[tuple[int, int, int]]) -> bool:
        name = "can_vacuum_maintain" if conn.info.server_version >= 170000 else "can_vacuum_owner"
        row = conn.execute(query(name, self._schema), {"schema": self._schema}).fetchone()
        if row and row[0]:
            return True
        log.warning(
            "this role may not VACUUM %s.events (it needs to own it, or MAINTAIN on PostgreSQL 17+); "
            "the relay leaves the table to autovacuum",
            self._schema,
        )
        return False

    def check(self, conn: psycopg.Connection[tuple[int, int, int]]) -> float:
        """Vacuum if needed; return the seconds to wait before the next check."""
        stats = query("hot_table_stats", self._schema)
        row = conn.execute(stats, {"schema": self._schema}).fetchone()
        if row is None:
            return self._interval
        dead, live, size = (int(v) for v in row)
        if not self.needs_vacuum(dead, live, size):
            return self._interval
        if self.allowed is None:
            self.allowed = self._may_vacuum(conn)
        if not self.allowed:
            return MAX_BACKOFF
        locked = conn.execute(query("hygiene_try_lock", self._schema), {"lock": self._lock_key}).fetchone()
        if not locked or not locked[0]:
            return self._interval  # another relay is on it
        try:
            started = time.monotonic()
            conn.execute(query("vacuum_events", self._schema))
            took = time.monotonic() - started
        finally:
            conn.execute(query("hygiene_unlock", self._schema), {"lock": self._lock_key})
        self.vacuums += 1
        after = conn.execute(stats, {"schema": self._schema}).fetchone()
        dead_after, _, size_after = (int(v) for v in after) if after else (0, 0, 0)
        log.info(
            "vacuumed %s.events in %.2fs: dead tuples %d -> %d, size %.1f -> %.1f MiB",
            self._schema,
            took,
            dead,
            dead_after,
            size / 2**20,
            size_after / 2**20,
        )
        if dead_after >= self._threshold and dead_after > dead // 2:
            oldest = conn.execute(query("oldest_xmin_age", self._schema)).fetchone()
            age = float(oldest[0]) if oldest and oldest[0] is not None else None
            log.warning(
                "vacuum could not remove %d dead tuples of %s.events: a snapshot is held open "
                "(oldest for %s); the table grows until it is released",
                dead_after,
                self._schema,
                "unknown" if age is None else f"{age:.0f} s",
            )
            # Scanning again will not help until that snapshot goes: back off.
            return min(MAX_BACKOFF, max(self._interval, took * 10))
        return self._interval
