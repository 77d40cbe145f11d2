"""A claim of one outbox's table on a session of its own, and the rows handed on as a batch: what
the intake, a limit's claims and a WAL lane's table turns share."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from outbox.relay.batch import Batch
from outbox.relay.lanes import Lane
from outbox.store.sessions import Sessions

# The dispatcher's send: (lane, batch, when its claim started, the claim's limit, flush now?) -> events.
Send = Callable[[Lane, Batch, int, int, bool], int]
Claimed = tuple[psycopg.Connection[Any], list[tuple[Any, ...]], int]  # session, rows, claim start (ns)


class TableClaim:
    """``send``: the dispatcher's, which the batches are handed on to; ``claimed``: a claim went
    through, with how many events (recorded, and the loop's progress for the stall watchdog);
    ``lane_error``: an error of one outbox's own, which rests it."""

    def __init__(
        self,
        sessions: Sessions,
        *,
        send: Send,
        claimed: Callable[[Lane, int], None],
        lane_error: Callable[[Lane, psycopg.Connection[Any], str], None],
    ) -> None:
        self.sessions = sessions
        self._send = send
        self._claimed = claimed
        self._lane_error = lane_error

    def claim(self, lane: Lane, limit: int, only: str | None, skip: str | None) -> Claimed | None:
        """A session taken and a claim of ``lane`` on it; None: no session now, or the claim failed
        (the session lost, or this outbox's own error)."""
        conn = self.sessions.take()
        if conn is None:
            return None
        claim_start = time.time_ns()
        rows = self.rows(lane, conn, limit, only, skip)
        return None if rows is None else (conn, rows, claim_start)

    def hand_on(self, lane: Lane, claimed: Claimed, limit: int) -> int:
        """The claimed rows as a batch, to the dispatcher (none: the session goes back)."""
        conn, rows, claim_start = claimed
        if not rows:
            self.sessions.give_back(conn)
            return 0
        return self._send(lane, batch_of(lane, conn, rows), claim_start, limit, True)

    def rows(
        self, lane: Lane, conn: psycopg.Connection[Any], limit: int, only: str | None, skip: str | None
    ) -> list[tuple[Any, ...]] | None:
        """Claim on ``conn``: the rows (none: the empty claim committed), or None when it failed
        (the session lost, or this outbox's own error)."""
        sessions = self.sessions
        try:
            rows = lane.ordering.claim(conn, limit, only, skip)
            if not rows:
                conn.commit()  # not rollback(): that drops the prepared claim (Sessions.end)
        except psycopg.OperationalError as exc:
            # Connection gone, server restarting, session ended (also between an
            # empty claim and its commit): nothing was claimed that will not be
            # claimed again.
            sessions.lost(conn, f"claim failed: {sessions.clean(exc)}")
            return None
        except psycopg.Error as exc:
            # The database answers, but not for this outbox (its schema dropped, not migrated,
            # a privilege taken away): this outbox rests, the others go on.
            self._lane_error(lane, conn, f"claim failed: {sessions.clean(exc)}")
            return None
        self.went_through(lane, len(rows))
        return rows

    def went_through(self, lane: Lane, events: int) -> None:
        """A claim of ``lane`` went through (or a WAL batch was taken), with ``events`` (0: empty):
        the database and the outbox answer."""
        self.sessions.database.ok()
        lane.trouble.ok()
        self._claimed(lane, events)
        if events:
            lane.last_work = time.monotonic()


def batch_of(lane: Lane, conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> Batch:
    """The batch of rows claimed from ``lane`` on ``conn``, with the outbox's key holds."""
    ordering = lane.ordering
    return Batch(conn, rows, holds=ordering.holds if ordering.ordered else None, parks=ordering.parks)
