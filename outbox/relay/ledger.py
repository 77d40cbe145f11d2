"""The ledger: the batches in flight of every lane, and the one place a batch leaves.

A batch comes in when it is sent (:meth:`Ledger.sent`) and leaves in :meth:`Ledger.done`: its
session goes back, its key holds are released, its limit's slot is freed, its outbox's pace and
retry time are updated, and a WAL batch's position is confirmed to the slot, or the slot is read
again from the last one confirmed. Nothing else takes a batch out of a lane.

Anchor: River's ``jobcompleter`` reports a job done on a channel; the producer's one ``select``
frees its slot. Here the finisher reports, and this is the slot.
"""

from __future__ import annotations

import time

from outbox.relay import limits
from outbox.relay.batch import Batch
from outbox.relay.lanes import Lane
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.wal_batch import WalBatch
from outbox.store.membership import Membership
from outbox.store.sessions import Link, Sessions


class Ledger:
    """``busy``: the lanes with batches in flight, in the order they became so (what the loop's
    every step looks at)."""

    def __init__(
        self, sessions: Sessions, link: Link, membership: Membership, scheduler: ClaimScheduler
    ) -> None:
        self.sessions = sessions
        self.link = link
        self.membership = membership
        self.scheduler = scheduler
        self.busy: dict[Lane, None] = {}

    def sent(self, lane: Lane, batch: Batch) -> None:
        """``batch`` is out: its outcomes will come through ``batch.settle``."""
        lane.in_flight.append(batch)
        self.busy[lane] = None

    def waiting(self) -> tuple[int, int]:
        """Events in flight awaiting a report, and the batches awaiting none (complete)."""
        events = complete = 0
        for lane in self.busy:
            for batch in lane.in_flight:
                left = batch.waiting
                events += left
                complete += not left
        return events, complete

    def flights(self) -> list[tuple[Lane, Batch]]:
        """Every batch in flight, with its lane, in the order each lane sent them."""
        return [(lane, batch) for lane in list(self.busy) for batch in lane.in_flight]

    def done(
        self,
        lane: Lane,
        batch: Batch,
        *,
        paced: tuple[bool, float] | None = None,
        retry_in: float | None = None,
        alone: bool = False,
    ) -> list[Batch]:
        """``batch`` leaves: its session back to the pool, its key holds released, its limit's
        slot freed; a WAL batch's position confirmed to the slot if it committed, else read again.

        ``paced``: (the lease ran out, when) for the outbox's pace; ``retry_in``: seconds until a
        retry it scheduled comes due; ``alone``: its shared transaction failed on a statement, so
        the outbox claims alone a while. Returns the WAL batches read after a WAL batch that did
        not commit: the caller releases each (``leave``), once its finisher gave up."""
        if batch not in lane.in_flight:  # abandoned already: a WAL batch read before it failed
            return []
        scheduler = self.scheduler
        if retry_in is not None:  # claim again when it comes due, not at the next poll
            scheduler.retry_due_in(lane, retry_in)
        if alone:
            scheduler.alone(lane, time.monotonic())
        self.leave(lane, batch)
        if paced is not None:
            scheduler.pace(lane, batch, *paced)
        if not isinstance(batch, WalBatch) or lane.wal is None:
            return []
        if batch.finished:
            lane.wal.confirm(batch.after)
            return []
        # Not handed on: the slot sends it again, from the confirmed position; so every WAL
        # batch read after it goes too (sent again, and not archived twice).
        lane.wal.rewind()
        return [b for b in lane.in_flight if isinstance(b, WalBatch)]

    def leave(self, lane: Lane, batch: Batch) -> None:
        """``batch`` out of its lane: its limit's slot, its key holds and its session let go."""
        if batch.gate is not None:
            limits.finished(self.link, self.membership.id, lane.schema, batch.gate, batch.size)
        lane.in_flight.remove(batch)
        lane.ordering.holds.release(id(batch))
        shared = batch.shared
        if shared is not None:
            shared.left -= 1
            if shared.left == 0:
                # Its batches and it refer to each other: a cycle only the garbage collector
                # frees, when it runs, and their rows stayed in memory until then (decision 0002).
                shared.members.clear()
        if shared is None or shared.left == 0:  # a shared session goes back with its last batch
            self.sessions.give_back(batch.conn)
        if not lane.in_flight:
            self.busy.pop(lane, None)
