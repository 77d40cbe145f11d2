"""The batch finisher (the completer): a batch whose every event has an outcome is finished here.

Finishing a batch is its statements and its commit (archive the delivered, persist the retries,
dead-letter the dead), run on a finisher thread so that the loop produces the next batch
meanwhile; the thread wakes the loop, which records the result and lets the batch leave through
the :class:`~outbox.relay.ledger.Ledger`. A lane's WAL batches commit one at a time, in the order
read: each commits the slot position it reaches, and a later one committed first would have a
restart skip the earlier one's events.

Anchors: River's ``jobcompleter``, kept apart from its producer; Sequin's reorder buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any

import psycopg

from outbox.errors import FencingError
from outbox.relay.batch import Batch, BatchResult, RolledBack, Shared
from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Lane
from outbox.relay.ledger import Ledger
from outbox.relay.recorder import BatchRecorder
from outbox.sinks.base import SINK_REPLACED, Retry, Sink
from outbox.store.sessions import Sessions

log = logging.getLogger("outbox.relay")


class _NotHandedOn(Exception):
    """A WAL batch's finisher gave up: the batch read before it did not commit."""


class BatchFinisher:
    """The batches being finished, on the finisher's threads; the ledger keeps those in flight."""

    def __init__(
        self,
        config: RelayConfig,
        sessions: Sessions,
        ledger: Ledger,
        recorder: BatchRecorder,
        *,
        lanes: Callable[[], Iterable[Lane]],
        sink: Callable[[], Sink | None],
        metrics_on: Callable[[], bool],
        wake: Callable[[], None],
    ) -> None:
        """``lanes``: the outboxes served; ``sink``: the relay's sink now (it is replaced when
        unhealthy); ``metrics_on``: whether a finish lists its latencies; ``wake``: the loop's
        wake-up, called as a finish is done."""
        self.config = config
        self.sessions = sessions
        self.ledger = ledger
        self.recorder = recorder
        self._lanes = lanes
        self._sink = sink
        self._metrics_on = metrics_on
        self._wake = wake
        # A finisher per session of the budget (each batch has a session of its own): one
        # outbox's finish that waits (a lock on its archive) holds up no other outbox's.
        self._pool = ThreadPoolExecutor(config.max_connections, thread_name_prefix="outbox-finish")
        # Batches on a finisher, with the time each was handed over (recorded once done).
        # A shared transaction's batches have one future, whose result maps each one to its own.
        self.finishing: dict[Batch, tuple[Future[Any], int]] = {}
        self._finished_any = False  # a finisher finished a batch since the loop last looked

    def _woken(self, _future: Future[Any]) -> None:
        """A batch was finished (its thread): the loop records it and frees its slot now."""
        self._finished_any = True
        self._wake()

    def to_finish(self, complete: int) -> bool:
        """Is there work for :meth:`finish_complete`, with ``complete`` batches in flight awaiting
        no report: one of them not on a finisher yet, or a batch finished since the last look?
        (Every batch on a finisher is complete: more complete than on finishers is one to hand
        over.) The loop asks at every step; the walk over the batches is only made for news."""
        return self._finished_any or complete > len(self.finishing)

    def finish_complete(self) -> None:
        """Hand each batch whose every event has an outcome to a finisher thread, and record
        those finished. A WAL batch complete while the one read before it is still on a
        finisher is handed over to wait for it there, and to commit only if that one did (the
        loop would see that one done only at its next look, and the slot was idle meanwhile);
        one that fails rewinds the reader and releases those read after it (see done)."""
        self._finished_any = False  # first: a batch finished during the walk is looked at again
        for lane in list(self.ledger.busy):
            earlier: tuple[Batch, Future[BatchResult]] | None = None  # on a finisher, not done
            wal_waiting = False  # a WAL batch read earlier is not complete yet
            for batch in list(lane.in_flight):
                if batch not in lane.in_flight:  # abandoned by an earlier one's failure
                    continue
                pending = self.finishing.get(batch)
                if pending is not None:
                    # A WAL batch's result is taken only after the one before it: that one may
                    # have finished (and this one, behind it, given up) since it was looked at.
                    if pending[0].done() and (earlier is None or not batch.from_wal):
                        self._finished(lane, batch)
                    elif batch.from_wal:
                        earlier = (batch, pending[0])
                    continue
                if batch.from_wal:
                    if batch.complete and not wal_waiting:
                        self._hand_over(lane, batch, earlier)
                        earlier = (batch, self.finishing[batch][0])
                    else:
                        wal_waiting = True
                elif batch.shared is not None:
                    if batch.settled_at is None and batch.complete:
                        batch.settled_at = time.monotonic()  # its pace: not the others' (see _outcome)
                    if not batch.shared.handed and batch.shared.complete:
                        self._hand_over_shared(batch.shared)
                elif batch.complete:
                    self._hand_over(lane, batch)

    def _hand_over(
        self, lane: Lane, batch: Batch, earlier: tuple[Batch, Future[BatchResult]] | None = None
    ) -> None:
        """Finish ``batch`` on a finisher thread: its statements and commit, a round trip the
        loop does not wait for. The next batch is produced meanwhile (decision 0002).
        ``earlier``: the WAL batch read before it, to wait for (see _finish_after)."""
        ack_start = time.time_ns()
        if earlier is None:
            future = self._pool.submit(self._finish_of(lane, batch))
        else:
            future = self._pool.submit(self._finish_after, *earlier, self._finish_of(lane, batch))
        future.add_done_callback(self._woken)
        self.finishing[batch] = (future, ack_start)

    def _hand_over_shared(self, shared: Shared) -> None:
        """Finish the batches of a shared transaction on a finisher thread, all at once: their
        statements and one commit. Each member's future is the same; its result is theirs."""
        shared.handed = True
        ack_start = time.time_ns()
        future = self._pool.submit(self._shared_statements, shared)
        future.add_done_callback(self._woken)
        for _, batch in shared.members:
            self.finishing[batch] = (future, ack_start)

    def _shared_statements(self, shared: Shared) -> dict[Batch, BatchResult | Exception]:
        config = self.config
        return shared.finish(config.retry, archive=config.archive, latencies=self._metrics_on())

    def _finish_of(self, lane: Lane, batch: Batch) -> Callable[[], BatchResult]:
        """The batch's statements and commit, as a call to make (on a finisher, or on the loop)."""
        config = self.config
        return partial(
            batch.finish,
            lane.schema,
            config.retry,
            archive=config.archive,
            latencies=self._metrics_on(),  # for the latency histogram only
        )

    @staticmethod
    def _finish_after(
        earlier: Batch, its: Future[BatchResult], finish: Callable[[], BatchResult]
    ) -> BatchResult:
        """On a finisher: wait for the WAL batch read before this one, then ``finish`` it if
        that one committed. If it did not, this batch is left as it is, unwritten: the loop
        rewinds the reader and releases it with every batch read after the failed one. (Futures
        are handed over in the order read and never wait for a later one, and a lane's batches
        in flight each hold a session, so no more run than the finisher has threads.)"""
        its.exception()  # waits
        if not earlier.finished:
            raise _NotHandedOn("the WAL batch read before it did not commit")
        return finish()

    def await_all(self) -> None:
        """Wait for the finishers and record what they finished: before anything that rolls back,
        settles or finishes batches in flight on the loop itself (a finisher owns a batch's
        session until then)."""
        for lane in list(self.ledger.busy):
            for batch in list(lane.in_flight):
                pending = self.finishing.get(batch)
                if pending is not None:
                    pending[0].exception()  # waits
                    self._finished(lane, batch)

    def _finished(self, lane: Lane, batch: Batch) -> None:
        future, ack_start = self.finishing.pop(batch)
        exc = future.exception()
        if exc is None:
            result = future.result()
            self._outcome(lane, batch, result[batch] if isinstance(result, dict) else result, ack_start)
        elif isinstance(exc, (FencingError, psycopg.Error)):
            self._outcome(lane, batch, exc, ack_start)
        else:
            raise exc

    def finish_here(self, lane: Lane, batch: Batch) -> None:
        """Finish ``batch`` on the loop (a sink replaced: its batches settled at once); a batch of
        a shared transaction, with every member (settled already: settle_unreported)."""
        ack_start = time.time_ns()
        shared = batch.shared
        if shared is not None:
            if shared.handed:  # finished with an earlier member
                return
            shared.handed = True
            results = self._shared_statements(shared)
            lanes = {b: each for each, b in self.ledger.flights()}
            for _, member in shared.members:
                self._outcome(lanes[member], member, results[member], ack_start)
            return
        outcome: BatchResult | Exception
        try:
            outcome = self._finish_of(lane, batch)()
        except (FencingError, psycopg.Error) as exc:
            outcome = exc
        self._outcome(lane, batch, outcome, ack_start)

    def settle_unreported(self) -> None:
        """The sink was replaced before it reported: what it did not report counts as failed for
        an unreachable sink, and every batch is finished here, not rolled back, so that what was
        delivered is archived once (the key holds its later events: per-key order)."""
        unreported = Retry(SINK_REPLACED, "the sink's client was replaced before it reported")
        flights = self.ledger.flights()
        for _, batch in flights:
            for i, outcome in enumerate(batch.outcomes):
                if outcome is None:
                    batch.settle(i, unreported)
        for lane, batch in flights:
            self.finish_here(lane, batch)

    def _outcome(self, lane: Lane, batch: Batch, outcome: BatchResult | Exception, ack_start: int) -> None:
        recorder = self.recorder
        if isinstance(outcome, FencingError):
            recorder.lease_lost(lane, batch, str(outcome), ack_start)
            self._release_after(
                lane, self.ledger.done(lane, batch)
            )  # fenced: its partition was taken over, nothing about the sink
            return
        if isinstance(outcome, (psycopg.Error, RolledBack)):
            exc = outcome
            sessions = self.sessions
            if isinstance(exc, psycopg.Error) and (batch.conn.closed or batch.conn.broken):
                # The lease ran out (idle_in_transaction_session_timeout ended the
                # session) or the connection broke: the ack did not commit.
                recorder.lease_lost(lane, batch, f"connection lost: {sessions.clean(exc)}", ack_start)
                sessions.discard(batch.conn)
                # The lease ran out (not a server restart or a dropped connection): too slow.
                now = time.monotonic()
                lost = now - batch.claimed_at >= self.config.lease
                self._release_after(lane, self.ledger.done(lane, batch, paced=(lost, now)))
                return
            # The statement failed on a live connection: a bug or a schema change.
            log.error(
                "ack of %d events failed, they stay pending: %s",
                batch.size,
                sessions.clean(exc),
                extra={
                    "outbox": lane.name,
                    "event": "batch.rolled_back",
                    "batch_age": round(time.monotonic() - batch.claimed_at, 3),
                },
            )
            recorder.end_spans(batch, ack_start, type(exc).__name__)
            batch.release()
            # A shared one's outbox claims alone for a while: the error is its own.
            self._release_after(lane, self.ledger.done(lane, batch, alone=batch.shared is not None))
            return
        assert isinstance(outcome, BatchResult)
        result = outcome
        recorder.record(lane, batch, result, ack_start, self._sink())
        # A batch that only failed says nothing about the sink's pace. (A batch of a shared
        # transaction: when its own events had settled, not when the slowest member's had: a slow
        # outbox does not make the others' claims smaller.)
        paced = (False, batch.settled_at or time.monotonic()) if result.delivered else None
        self._release_after(lane, self.ledger.done(lane, batch, paced=paced, retry_in=result.next_retry))

    def _release_after(self, lane: Lane, later: list[Batch]) -> None:
        """The WAL batches read after one that did not commit (``Ledger.done`` returned them) go
        too, once their finishers gave up (they waited for it), unwritten."""
        for batch in later:
            waiting = self.finishing.pop(batch, None)
            if waiting is not None:  # its finisher waited for the failed one: it gives up, unwritten
                waiting[0].exception()
            self.recorder.end_spans(batch, time.time_ns(), "released")
            batch.release()
            self.ledger.leave(lane, batch)

    def let_go_of_the_wal(self) -> None:
        """The database cannot be reached (take() waits to try again): WAL capture's readers let
        go of their streams. A reader keeps its stream open while the WAL it read is not handed
        on, and a server shutting down waits for its walsender until the reader confirms all it
        was sent (or wal_sender_timeout, 60 s): a restart stood still for a minute, pg_ctl gave
        up, and this loop waited on the very database that waited on it. So the WAL batches in
        flight are released (they cannot commit now) and the reader reads again once the
        database is back, from the position last committed."""
        self.await_all()
        for lane in self._lanes():
            if lane.wal is None:
                continue
            first = next((b for b in lane.in_flight if b.from_wal), None)
            if first is None:
                lane.wal.rewind()  # what it queued, and its stream
                continue
            self.recorder.end_spans(first, time.time_ns(), "released")
            first.release()
            self._release_after(
                lane, self.ledger.done(lane, first)
            )  # rewinds the reader, releases the WAL batches read after it

    def release_all(self, why: str) -> None:
        """Roll back every in-flight batch: their events can be claimed again at once."""
        self.await_all()
        for lane, batch in self.ledger.flights():
            if batch in lane.in_flight:  # (not abandoned with a WAL batch read before it)
                self.recorder.end_spans(batch, time.time_ns(), "released")
                batch.release()
                self._release_after(lane, self.ledger.done(lane, batch))
        if why:
            log.info("released in-flight batches: %s", why)

    def shutdown(self) -> None:
        self._pool.shutdown()
