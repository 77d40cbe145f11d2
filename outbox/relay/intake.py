"""The intake: a batch of an outbox claimed from its table, alone or with other outboxes' in one
transaction (their claims sent ahead, in pipeline mode), and handed on to the dispatcher. It
never talks to the sink. A limit's claims (``outbox.relay.gated``) and a WAL lane's turns
(``outbox.relay.wal_intake``) claim through it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg

from outbox.relay.batch import PIPELINE, Batch, Shared
from outbox.relay.lanes import Lane
from outbox.relay.pipelined import Picks, Pipelined
from outbox.relay.scheduler import ClaimScheduler
from outbox.store.sessions import Sessions

# The dispatcher's send: (lane, batch, when its claim started, the claim's limit, flush now?) -> events.
Send = Callable[[Lane, Batch, int, int, bool], int]
Claimed = tuple[psycopg.Connection[Any], list[tuple[Any, ...]], int]  # session, rows, claim start (ns)


class Intake:
    """Claims batches from the outboxes' tables. ``send`` and ``flush``: the dispatcher's, which
    the batches are handed on to; ``claimed``: a claim went through (recorded, and the loop's
    progress for the stall watchdog); ``lane_error``: an error of one outbox's own, which rests it."""

    def __init__(
        self,
        sessions: Sessions,
        scheduler: ClaimScheduler,
        *,
        send: Send,
        flush: Callable[[bool], None],
        claimed: Callable[[Lane], None],
        lane_error: Callable[[Lane, psycopg.Connection[Any], str], None],
    ) -> None:
        self.sessions = sessions
        self.scheduler = scheduler
        self._send = send
        self._flush = flush
        self._claimed = claimed
        self._lane_error = lane_error
        self.ahead: Pipelined | None = None  # claims sent during the last step, their rows not read

    def claim_and_send(self, lane: Lane, limit: int) -> int:
        """A batch of at most ``limit`` events of ``lane`` claimed and handed on; how many it had."""
        if not lane.table_known:  # a slot to read before the table?
            return 0
        claimed = self.claim(lane, limit, None, lane.skip)
        return 0 if claimed is None else self.hand_on(lane, claimed, limit)

    def claim(self, lane: Lane, limit: int, only: str | None, skip: str | None) -> Claimed | None:
        """A session taken and a claim of ``lane`` on it; None: no session now, or the claim failed
        (the session lost, or this outbox's own error)."""
        conn = self.sessions.take()
        if conn is None:
            return None
        claim_start = time.time_ns()
        rows = self._claim(lane, conn, limit, only, skip)
        return None if rows is None else (conn, rows, claim_start)

    def hand_on(self, lane: Lane, claimed: Claimed, limit: int) -> int:
        """The claimed rows as a batch, to the dispatcher (none: the session goes back)."""
        conn, rows, claim_start = claimed
        if not rows:
            self.sessions.give_back(conn)
            return 0
        return self._send(lane, batch_of(lane, conn, rows), claim_start, limit, True)

    def claim_shared(self, picks: Picks, next_claims: Callable[[], Picks]) -> list[int] | None:
        """Batches of several outboxes (``picks``: each lane and its claim's limit) claimed in one
        transaction, their claims in one round trip (pipeline mode), sent, and acknowledged with
        one wait; how many events each had. None: the claims failed (the session lost, or one
        outbox's own error: each then claims alone for a while, where the error is its own).

        The claims are those sent ahead during the last step (``self.ahead``) if there are, else
        sent now. Once their rows are in, the next claims (``next_claims()``) are sent ahead: the
        server runs them while these batches are decoded and sent (outbox.pipelined)."""
        sessions = self.sessions
        claims, self.ahead = self.ahead, None
        if claims is None:
            conn = sessions.take()
            if conn is None:
                return [0] * len(picks)
            claims = Pipelined(conn, picks, time.time_ns())
            if not self._sent(claims):
                return None
        assert claims.picks is picks
        conn = claims.conn
        try:
            claimed = claims.rows()  # they stay claiming: not among the next claims
        except psycopg.Error as exc:
            self._claims_failed(claims, exc)
            return None
        try:
            for (lane, _), rows in zip(picks, claimed, strict=True):
                self.went_through(lane, bool(rows))
            if PIPELINE:
                self._send_ahead(next_claims())
        finally:
            claims.done()
        shared = Shared(conn)
        short = False
        counts = []
        for (lane, limit), rows in zip(picks, claimed, strict=True):
            if lane.leaving:  # no longer served (since its claim was sent): its rows stay pending
                rows = []
            counts.append(len(rows))
            if not rows:
                continue
            batch = batch_of(lane, conn, rows)
            shared.add(lane.schema, batch)
            self._send(lane, batch, claims.claim_start, limit, False)
            short = short or len(rows) < limit
        if not shared.members:
            sessions.end(conn)
            return counts
        self._flush(short)  # one wait for the acks of them all (see Dispatcher.send)
        return counts

    def _send_ahead(self, picks: Picks) -> None:
        """The claims of ``picks`` sent now, read at the loop's next claim (``self.ahead``)."""
        if not picks:
            return
        conn = self.sessions.take()
        if conn is not None:
            claims = Pipelined(conn, picks, time.time_ns())
            if self._sent(claims):
                self.ahead = claims
                return
        self._claim_again(picks)  # stopping while reconnecting, or the claims failed

    def _sent(self, claims: Pipelined) -> bool:
        try:
            claims.send()
        except psycopg.Error as exc:
            self._claims_failed(claims, exc)
            return False
        return True

    def _claims_failed(self, claims: Pipelined, exc: psycopg.Error) -> None:
        sessions = self.sessions
        if isinstance(exc, psycopg.OperationalError):
            sessions.lost(claims.conn, f"claim failed: {sessions.clean(exc)}")
            return
        # One of these outboxes cannot be claimed from (its schema dropped, a privilege taken
        # away): which one, each one's claim alone says, in its own lane.
        now = time.monotonic()
        for lane, _ in claims.picks:
            self.scheduler.alone(lane, now)
        sessions.roll_back(claims.conn)

    def _claim_again(self, picks: Picks) -> None:
        for lane, _ in picks:
            self.scheduler.claim_again(lane)

    def give_up_ahead(self) -> None:
        """Claims sent ahead, not read (the relay stops, or lost its connection): rolled back, their
        events pending as they were (none was sent)."""
        claims, self.ahead = self.ahead, None
        if claims is None:
            return
        claims.close()
        self._claim_again(claims.picks)
        self.sessions.roll_back(claims.conn)

    def _claim(
        self, lane: Lane, conn: psycopg.Connection[Any], limit: int, only: str | None, skip: str | None
    ) -> list[tuple[Any, ...]] | None:
        """Claim on ``conn``: the rows (none: rolled back), or None when it failed (the session
        lost, or this outbox's own error)."""
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
        self.went_through(lane, bool(rows))
        return rows

    def went_through(self, lane: Lane, work: bool) -> None:
        """A claim of ``lane`` went through (or a WAL batch was taken), empty or not (``work``):
        the database and the outbox answer."""
        self.sessions.database.ok()
        lane.trouble.ok()
        self._claimed(lane)
        if work:
            lane.last_work = time.monotonic()


def batch_of(lane: Lane, conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> Batch:
    """The batch of rows claimed from ``lane`` on ``conn``, with the outbox's key holds."""
    ordering = lane.ordering
    return Batch(conn, rows, holds=ordering.holds if ordering.ordered else None, parks=ordering.parks)
