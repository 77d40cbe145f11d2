"""A WAL lane's intake: the transactions its reader read from the slot, and the table's events
(retries, delayed, held behind a failure), taking turns; each batch handed on to the dispatcher."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, cast

import psycopg

from outbox.capture import behind
from outbox.events import KEY_OF
from outbox.relay.claim import Send, TableClaim
from outbox.relay.lanes import Lane
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.wal_batch import WalBatch
from outbox.store.sessions import Sessions


class WalIntake:
    """``table``: the table's claims; ``send``: the dispatcher's; ``lane_error``: an error of one
    outbox's own, which rests it."""

    def __init__(
        self,
        sessions: Sessions,
        scheduler: ClaimScheduler,
        table: TableClaim,
        *,
        send: Send,
        lane_error: Callable[[Lane, psycopg.Connection[Any], str], None],
    ) -> None:
        self.sessions = sessions
        self.scheduler = scheduler
        self.table = table
        self._send = send
        self._lane_error = lane_error

    def claim_and_send(self, lane: Lane, limit: int) -> int:
        """A batch of at most ``limit`` events of ``lane`` (which has a WAL reader), from the slot
        or from the table, handed on; how many it had."""
        wal = lane.wal
        assert wal is not None
        # The slot's transactions and the table's events (retries, delayed, held behind a failure)
        # take turns while the table has work: a NOTIFY since its last claim (every insert into
        # events sends one), a full last claim, or its poll timer. An empty claim every other
        # batch was a round trip per WAL batch for nothing (decision 0004). WAL batches go out
        # pipelined like claimed ones, and finish in the order read (BatchFinisher.finish_complete).
        lane.table.turn = not lane.table.turn
        table_due = lane.table.due or time.monotonic() >= lane.table.next_claim
        if wal.waiting and not (lane.table.turn and table_due):
            return self.read_and_send(lane, limit)
        if lane.upkept.capture_mode == "table" and not (wal.reading and wal.caught_up):
            # Switched back to table capture with the slot kept: the events still in the slot
            # were committed before the rows written since, so the table waits until this
            # relay has read the slot up to what the server has (a relay that stands by
            # claims nothing of this outbox until the slot is dropped).
            return 0
        claimed = self.table.claim(lane, limit, None, lane.skip)
        if claimed is None:
            return 0
        lane.table.due = len(claimed[1]) >= limit
        lane.table.next_claim = time.monotonic() + self.scheduler.jittered_poll()
        return self.table.hand_on(lane, claimed, limit)

    def table_news(self, lane: Lane) -> None:
        """Rows were inserted into ``lane``'s events table: its table takes its next turn."""
        lane.table.due = True

    def read_and_send(self, lane: Lane, limit: int) -> int:
        """WAL capture: send the next committed transactions read from the outbox's slot. The
        events of a key that has events waiting in the table (or a parked dead letter) are held,
        and go into the table behind them when the batch finishes."""
        assert lane.wal is not None
        sessions = self.sessions
        conn = sessions.take()
        if conn is None:
            return 0
        claim_start = time.time_ns()
        taken = lane.wal.take(limit)
        if taken is None:
            sessions.give_back(conn)
            return 0
        rows, after = taken
        ordering = lane.ordering
        batch = WalBatch(
            conn, rows, after, holds=ordering.holds if ordering.ordered else None, parks=ordering.parks
        )
        keys = set(map(KEY_OF, batch.stored))
        keys.discard(None)
        try:
            waiting = behind.keys_waiting(conn, lane.schema, cast("set[bytes]", keys))
        except psycopg.Error as exc:
            lane.wal.rewind()  # read again from the slot
            if isinstance(exc, psycopg.OperationalError):
                sessions.lost(conn, f"WAL batch failed: {sessions.clean(exc)}")
            else:
                self._lane_error(lane, conn, f"WAL batch failed: {sessions.clean(exc)}")
            return 0
        if waiting:  # held (into the table, behind them) when the key has older events waiting there
            for i, event in enumerate(batch.events):
                if event is not None and waiting.get(event.key, math.inf) <= event.created_at:
                    batch.hold(i)
        self.table.went_through(lane, batch.size)
        return self._send(lane, batch, claim_start, limit, True)
