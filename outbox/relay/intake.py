"""The intake: a batch of an outbox claimed from its table, alone or with other outboxes' in one
transaction (their claims sent ahead, in pipeline mode), and handed on to the dispatcher. It
never talks to the sink. A limit's claims (``outbox.relay.gated``) and a WAL lane's turns
(``outbox.relay.wal_intake``) are intakes of their own; all claim through
:class:`~outbox.relay.claim.TableClaim`."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from outbox.relay.batch import PIPELINE, Shared
from outbox.relay.claim import Send, TableClaim, batch_of
from outbox.relay.lanes import Lane
from outbox.relay.pipelined import Picks, Pipelined
from outbox.relay.scheduler import ClaimScheduler
from outbox.store.sessions import Sessions

__all__ = ["Intake", "Picks"]  # Picks: what a shared claim takes, for the claim step


class Intake:
    """Claims batches from the outboxes' tables (through ``table``). ``send`` and ``flush``: the
    dispatcher's, which the batches are handed on to."""

    def __init__(
        self,
        sessions: Sessions,
        scheduler: ClaimScheduler,
        table: TableClaim,
        *,
        send: Send,
        flush: Callable[[bool], None],
    ) -> None:
        self.sessions = sessions
        self.scheduler = scheduler
        self.table = table
        self._send = send
        self._flush = flush
        self.ahead: Pipelined | None = None  # claims sent during the last step, their rows not read

    def claim_and_send(self, lane: Lane, limit: int) -> int:
        """A batch of at most ``limit`` events of ``lane`` claimed and handed on; how many it had."""
        # Lane.table_known, for a lane with no WAL reader (those have an intake of their own): no
        # claim before a look at its capture said there is no slot to read first.
        if not lane.upkept.capture_mode:
            return 0
        claimed = self.table.claim(lane, limit, None, lane.skip)
        return 0 if claimed is None else self.table.hand_on(lane, claimed, limit)

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
                self.table.went_through(lane, 0 if lane.leaving else len(rows))
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
