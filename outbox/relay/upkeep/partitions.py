"""The archive's day partitions: each outbox's checked every hour, created ahead when missing."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg

from outbox.relay.lanes import Lane
from outbox.relay.upkeep.chores import Chores
from outbox.store.queries import query

PARTITION_MAINTENANCE = 3600.0  # seconds between archive partition checks
MAINTENANCE_RETRY = 10.0  # seconds before trying again after it failed
DAYS_AHEAD = 3  # the day partitions ensure_delivered_partitions() keeps ahead (its default)


class ArchivePartitions:
    """``rotation``: the outboxes served (the scheduler's list, read as it changes)."""

    def __init__(self, chores: Chores, rotation: Sequence[Lane]) -> None:
        self.chores = chores
        self.rotation = rotation
        self._next = 0.0  # monotonic time of the next check

    def next_at(self) -> float:
        return self._next

    def due(self, now: float) -> None:
        """The archive's day partitions of each outbox whose hourly check is due (one a step); the
        outboxes due are first asked about in one statement, and only those missing a partition
        get the call that creates it (at start, 1,000 outboxes were 1,000 transactions on the
        loop's thread in the middle of their first drain)."""
        if now < self._next:
            return
        rotation = self.rotation
        # The first due, not the list of them: at start every outbox is due, and a list each step
        # was a scan of every outbox per outbox (25 million looks at 5,000 outboxes).
        lane = next((x for x in rotation if now >= x.upkept.next_maintenance and not x.leaving), None)
        if lane is not None and not lane.upkept.partitions_missing:
            self._ask(now)
            lane = next((x for x in rotation if now >= x.upkept.next_maintenance and not x.leaving), None)
        if lane is None:
            self._next = min(
                (x.upkept.next_maintenance for x in rotation), default=now + PARTITION_MAINTENANCE
            )
            return
        lane.upkept.next_maintenance = now + PARTITION_MAINTENANCE
        lane.upkept.partitions_missing = False
        done = self.chores.on_session(
            lane,
            "archive partition maintenance",
            lambda conn: conn.execute(query("ensure_partitions", lane.schema)),
        )
        if done is None:
            lane.upkept.next_maintenance = now + MAINTENANCE_RETRY

    def _ask(self, now: float) -> None:
        """One look at every due outbox's day partitions: those that have them all are checked
        for the hour; the rest are marked for ensure_partitions, one a step. Without a session
        free, the due outboxes get their calls as before; when the look fails, each gets its call,
        which says which outbox is in trouble."""
        due = [x for x in self.rotation if now >= x.upkept.next_maintenance and not x.leaving]
        sessions = self.chores.sessions
        conn = sessions.take()
        if conn is None:
            return
        try:
            rows = conn.execute(
                query("partitions_missing", due[0].schema),
                {"schemas": [x.schema for x in due], "days": DAYS_AHEAD},
            ).fetchall()
            missing = {row[0] for row in rows}
        except psycopg.OperationalError as exc:
            sessions.lost(conn, f"archive partition check failed: {sessions.clean(exc)}")
            return
        except psycopg.Error:
            missing = {x.schema for x in due}
            sessions.roll_back(conn)
        else:
            sessions.end(conn)
        for x in due:
            if x.schema in missing:
                x.upkept.partitions_missing = True
            else:
                x.upkept.next_maintenance = now + PARTITION_MAINTENANCE
