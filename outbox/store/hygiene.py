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
from collections.abc import Callable
from typing import Any

import psycopg

from outbox.observe.conditions import Condition
from outbox.store import pinning
from outbox.store.dsn import scrub, secrets_of
from outbox.store.queries import query

log = logging.getLogger("outbox.hygiene")

CHECK_INTERVAL = 5.0  # seconds between looks at the table's statistics
DEAD_TUPLES_THRESHOLD = 20_000  # vacuum once this many dead tuples have piled up
DRAINED_BYTES = 1 << 20  # bytes; a drained table whose heap is larger is vacuumed to truncate it
DRAINED_LIVE = 1000  # live tuples (estimated) under which the table counts as drained
# ... or fewer than one live tuple per this many bytes of heap: mostly empty space. Before
# PostgreSQL 15 the live estimate can stay in the thousands after a table drains (a vacuum
# during the drain sets it, and the deletes after are not all subtracted): seen in the matrix,
# 2,000 "live" in an empty 9.4 MiB table that was then never vacuumed.
DRAINED_BYTES_PER_LIVE = 2048
MAX_BACKOFF = 300.0  # seconds; longest pause after vacuums that could not clean up


class Hygiene(threading.Thread):
    """Vacuums ``<schema>.events`` of each schema served when needed, until ``stop`` is set.

    ``schemas``: one schema, or a function that says which schemas are served now (a relay
    serving many outboxes of one database: one thread and one connection for them all)."""

    def __init__(
        self,
        dsn: str,
        schemas: str | Callable[[], list[str]],
        stop: threading.Event,
        *,
        threshold: int = DEAD_TUPLES_THRESHOLD,
        interval: float = CHECK_INTERVAL,
    ) -> None:
        super().__init__(name="outbox-hygiene", daemon=True)
        self._dsn = dsn
        self._schemas: Callable[[], list[str]] = (lambda: [schemas]) if isinstance(schemas, str) else schemas
        self._stop_event = stop
        self._threshold = threshold
        self._interval = interval
        self.vacuums = 0
        # Per schema: may this role VACUUM its table (learnt on its first vacuum), and when to
        # look at it again (later after a vacuum that could not clean up).
        self.allowed: dict[str, bool] = {}
        self._next: dict[str, float] = {}
        self._fruitless: dict[str, int] = {}  # vacuums in a row that did not shrink the table
        self.condition = Condition(log, "hygiene", "hot-table check failing")
        # Per schema: a snapshot held open keeps its dead tuples. One line when that starts, a
        # summary a minute while it lasts (the table is looked at every few seconds), one when
        # a vacuum removes them again.
        self.held: dict[str, Condition] = {}

    def run(self) -> None:
        wait = self._interval
        # One session kept from check to check: a new one reads every table's catalog entry
        # afresh each time, for the tables' sizes (decision 0013).
        conn: psycopg.Connection[Any] | None = None
        try:
            while not self._stop_event.wait(wait):
                try:
                    if conn is None or conn.closed:
                        conn = pinning.connect(self._dsn, autocommit=True, application_name="outbox-hygiene")
                    wait = self.check(conn)
                    self.condition.ok()
                except psycopg.Error as exc:
                    self.condition.fail(scrub(str(exc), secrets_of(self._dsn)))
                    wait = self._interval
                    if conn is not None:
                        conn.close()
                        conn = None
        finally:
            if conn is not None:
                conn.close()

    def needs_vacuum(self, dead: int, live: int, size: int) -> bool:
        """Vacuum when dead tuples dominate the table, or a drained table is still large.
        ``size``: the heap's bytes. Its indexes are left out: VACUUM does not shrink their
        files, so a drained table whose indexes grew (retries, a past backlog) would be
        vacuumed on every check, for nothing.

        Not while a large backlog is being drained (dead < live): VACUUM would scan the
        whole table to reclaim a minority of it, taking CPU from the drain itself.
        """
        if dead >= self._threshold and dead >= live:
            return True
        # Drained (or nearly: n_live_tup is an estimate that drifts) but still large, or mostly
        # empty space: a vacuum now frees the pages and truncates the file (a table whose last
        # pages still hold events is looked at less and less: _vacuum). Whatever the dead count
        # says: it can read 0 in a table of nothing but dead tuples, after a statistics reset
        # (a crash, pg_stat_reset) or, before PostgreSQL 15, when a vacuum during the drain
        # zeroes it and the last deletes stay unreported in an idle session (the matrix: 0 dead,
        # 3,800 "live" in an empty 9.4 MiB table, never vacuumed).
        return live < max(DRAINED_LIVE, size // DRAINED_BYTES_PER_LIVE) and size > DRAINED_BYTES

    def _may_vacuum(self, conn: psycopg.Connection[Any], schema: str) -> bool:
        name = "can_vacuum_maintain" if conn.info.server_version >= 170000 else "can_vacuum_owner"
        row = conn.execute(query(name, schema), {"schema": schema}).fetchone()
        if row and row[0]:
            return True
        log.warning(
            "this role may not VACUUM %s.events (it needs to own it, or MAINTAIN on PostgreSQL 17+); "
            "the relay leaves the table to autovacuum",
            schema,
        )
        return False

    def check(self, conn: psycopg.Connection[Any]) -> float:
        """Vacuum the tables that need it; return the seconds to wait before the next check."""
        now = time.monotonic()
        schemas = [s for s in self._schemas() if self._next.get(s, 0.0) <= now]
        if not schemas:
            return self._interval
        rows = conn.execute(query("hot_tables_stats", "public"), {"schemas": schemas}).fetchall()
        for schema, dead, live, heap in rows:
            if self.needs_vacuum(int(dead), int(live), int(heap)):
                self._next[schema] = now + self._vacuum(conn, schema, int(dead), int(heap))
        return self._interval

    def _vacuum(self, conn: psycopg.Connection[Any], schema: str, dead: int, heap: int) -> float:
        """Vacuum one schema's table (if this role may, and no other relay is on it); return
        the seconds before it is looked at again."""
        if schema not in self.allowed:
            self.allowed[schema] = self._may_vacuum(conn, schema)
        if not self.allowed[schema]:
            return MAX_BACKOFF
        before = conn.execute(query("hot_table_stats", schema), {"schema": schema}).fetchone()
        size = int(before[2]) if before else 0  # with its indexes, for the log
        lock = _lock_key(schema)
        locked = conn.execute(query("hygiene_try_lock", schema), {"lock": lock}).fetchone()
        if not locked or not locked[0]:
            return 0.0  # another relay is on it
        try:
            started = time.monotonic()
            conn.execute(query("vacuum_events", schema))
            took = time.monotonic() - started
        finally:
            conn.execute(query("hygiene_unlock", schema), {"lock": lock})
        self.vacuums += 1
        after = conn.execute(query("hot_table_stats", schema), {"schema": schema}).fetchone()
        dead_after, _, size_after = (int(v) for v in after) if after else (0, 0, 0)
        log.info(
            "vacuumed %s.events in %.2fs: dead tuples %d -> %d, size %.1f -> %.1f MiB",
            schema,
            took,
            dead,
            dead_after,
            size / 2**20,
            size_after / 2**20,
        )
        if dead_after >= self._threshold and dead_after > dead // 2:
            oldest = conn.execute(query("oldest_xmin_age", schema)).fetchone()
            age = float(oldest[0]) if oldest and oldest[0] is not None else None
            if age is None or age < self._interval:
                # No snapshot older than a check: a transaction that just began (the relay's own
                # batches in a drain) or, before PostgreSQL 15, statistics that do not show the
                # vacuum yet. Nothing is held open: look again at the next check, without a
                # warning (backing off here left a drained table large for minutes).
                log.debug(
                    "vacuum of %s.events left %d dead tuples; no snapshot held longer than %.0f s: "
                    "looking again at the next check",
                    schema,
                    dead_after,
                    self._interval,
                )
                self._released(schema)
                return self._interval
            held = self.held.get(schema)
            if held is None:
                held = self.held[schema] = Condition(
                    log, "vacuum_held", f"vacuum of {schema}.events held back", fields={"schema": schema}
                )
            held.fail(
                f"could not remove {dead_after} dead tuples: a snapshot is held open "
                f"(oldest for {age:.0f} s); the table grows until it is released"
            )
            # Scanning again will not help until that snapshot goes: back off.
            return min(MAX_BACKOFF, max(self._interval, took * 10))
        self._released(schema)
        heaps = conn.execute(query("events_heap_bytes", schema), {"schema": schema}).fetchone()
        if dead < self._threshold and heaps and int(heaps[0]) >= heap:
            # A nearly drained table whose last pages still hold pending events (a slow sink's
            # backlog) cannot be truncated yet: vacuuming it every check did nothing but log a
            # line every 5 s. Look again later each time, until a vacuum shrinks it.
            n = self._fruitless[schema] = self._fruitless.get(schema, 0) + 1
            return min(MAX_BACKOFF, self._interval * float(2**n))
        self._fruitless.pop(schema, None)
        return 0.0

    def _released(self, schema: str) -> None:
        """A vacuum of ``schema``'s table was not held back: ends a held-snapshot episode (one line)."""
        held = self.held.get(schema)
        if held is not None:
            held.ok()


def _lock_key(schema: str) -> int:
    """The advisory lock that lets one relay at a time vacuum a schema's table."""
    return int.from_bytes(
        hashlib.sha256(f"outbox-hygiene:{schema}".encode()).digest()[:8], "big", signed=True
    )
