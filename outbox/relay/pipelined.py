"""Claims of several outboxes in one round trip: sent in psycopg's pipeline mode, their rows read
later.

The claims of a shared transaction (:class:`outbox.relay.batch.Shared`) go out together. The relay sends
the next transaction's claims before it decodes and sends the batches of the one it has just read
(:meth:`outbox.relay.intake.Intake.claim_shared`): the server runs them meanwhile, and their rows
are read at the loop's next claim, which then need not wait for them (decision 0013).

The server executes each claim as it arrives; its results wait on the connection until the
pipeline is synced. Until then the outboxes are ``claiming`` (:class:`outbox.relay.lanes.Lane`): no
other claim of theirs, no look at their ownership, and they do not leave.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg

from outbox.relay.batch import PIPELINE
from outbox.relay.lanes import Lane

Picks = list[tuple[Lane, int]]  # each outbox and its claim's limit


class Pipelined:
    """The claims of ``picks`` on ``conn``: :meth:`send`, then :meth:`rows` (or :meth:`close`)."""

    def __init__(self, conn: psycopg.Connection[Any], picks: Picks, claim_start: int) -> None:
        self.conn = conn
        self.picks = picks
        self.claim_start = claim_start  # time.time_ns() when sent (the batches' spans start there)
        self._cursors: list[psycopg.Cursor[Any]] = []
        self._pipeline = contextlib.ExitStack()

    def send(self) -> None:
        """Every claim sent, none waited for; raises what the connection raised (the pipeline left).
        Without pipeline mode (libpq < 14), the claims run here, one round trip each."""
        for lane, _ in self.picks:
            lane.claiming = True
        if not PIPELINE:
            return
        try:
            self._pipeline.enter_context(self.conn.pipeline())
            conn = self.conn
            self._cursors = [
                lane.ordering.send_claim(conn, most, None, lane.skip) for lane, most in self.picks
            ]
        except BaseException:
            self.close()
            raise

    def rows(self) -> list[list[tuple[Any, ...]]]:
        """Each outbox's claimed rows, in the order of ``picks`` (raises what the claims raised).
        The outboxes stay ``claiming`` until :meth:`done`: the caller sends the next claims first,
        and these are not among them."""
        try:
            if not PIPELINE:
                return [lane.ordering.claim(self.conn, most, None, lane.skip) for lane, most in self.picks]
            self._pipeline.close()  # the sync: every claim's result in
            return [cur.fetchall() for cur in self._cursors]
        except BaseException:
            self.done()
            raise

    def close(self) -> None:
        """Leave the pipeline without reading the rows (the caller rolls the transaction back)."""
        try:
            with contextlib.suppress(psycopg.Error):
                self._pipeline.close()
        finally:
            self.done()

    def done(self) -> None:
        """The outboxes' claims are read or given up: they may claim (and be looked at) again."""
        for lane, _ in self.picks:
            lane.claiming = False
