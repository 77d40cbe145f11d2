"""The batch sender: claim a batch of an outbox (or take one its WAL reader read), then hand its
events to the sink. Their outcomes come back through ``Batch.settle``; the finisher takes it from
there."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import psycopg

from outbox.events import KEY_OF, ClaimedEvent
from outbox.observe import tracing
from outbox.relay import limits
from outbox.relay.batch import PIPELINE, Batch, Shared
from outbox.relay.lanes import Lane
from outbox.relay.ledger import Ledger
from outbox.relay.limits import Gate
from outbox.relay.metrics import RelayMetrics
from outbox.relay.pipelined import Picks, Pipelined
from outbox.relay.recorder import BatchRecorder
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.upkeep import CaptureWatch
from outbox.relay.wal_batch import WalBatch
from outbox.sinks import router
from outbox.sinks.base import ProducesMany, Sink, send_now
from outbox.sinks.chains import KeyChains
from outbox.store.membership import Membership
from outbox.store.queries import query
from outbox.store.sessions import Link, Sessions
from outbox.transform import Transforms

GATE_RETRY = 1.0  # seconds before a limit whose tokens could not be taken (an error) tries again
CAP_RECHECK = 0.05  # seconds before a limit at its in-flight cap looks again (another relay's may end)


class BatchSender:
    """Claims a batch (or takes one from the WAL) and hands its events to the sink.

    ``sink``: the relay's sink now (it is replaced when unhealthy); ``chains``: each outbox's key
    chains (SinkUpkeep's); ``metrics_on``: whether metrics are kept; ``progress``: the loop went
    on (a claim went through: RelayHealth's watchdog); ``lane_error``: an error of one outbox's
    own, which rests it."""

    def __init__(
        self,
        sessions: Sessions,
        link: Link,
        membership: Membership,
        scheduler: ClaimScheduler,
        ledger: Ledger,
        recorder: BatchRecorder,
        metrics: RelayMetrics,
        transforms: Transforms,
        *,
        sink: Callable[[], Sink | None],
        chains: dict[str, KeyChains],
        metrics_on: Callable[[], bool],
        progress: Callable[[], None],
        lane_error: Callable[[Lane, psycopg.Connection[Any], str], None],
    ) -> None:
        self.sessions = sessions
        self.link = link
        self.membership = membership
        self.scheduler = scheduler
        self.ledger = ledger
        self.recorder = recorder
        self.metrics = metrics
        self.transforms = transforms
        self._sink = sink
        self.chains = chains
        self._metrics_on = metrics_on
        self._progress = progress
        self._lane_error = lane_error
        self.ahead: Pipelined | None = None  # claims sent during the last step, their rows not read

    def claim_and_send(self, lane: Lane, limit: int) -> int:
        """A batch of at most ``limit`` events of ``lane``, sent; how many it had."""
        sessions = self.sessions
        if not CaptureWatch.table_known(lane):  # a slot to read before the table?
            return 0
        wal = lane.wal
        if wal is not None:
            # WAL capture: the slot's transactions and the table's events (retries, delayed, held
            # behind a failure) take turns while the table has work: a NOTIFY since its last
            # claim (every insert into events sends one), a full last claim, or its poll timer.
            # An empty claim every other batch was a round trip per WAL batch for nothing
            # (decision 0004). WAL batches go out pipelined like claimed
            # ones, and finish in the order they were read (BatchFinisher.finish_complete).
            lane.table.turn = not lane.table.turn
            table_due = lane.table.due or time.monotonic() >= lane.table.next_claim
            if wal.waiting and not (lane.table.turn and table_due):
                return self._read_and_send(lane, limit)
            if lane.upkept.capture_mode == "table" and not (wal.reading and wal.caught_up):
                # Switched back to table capture with the slot kept: the events still in the slot
                # were committed before the rows written since, so the table waits until this
                # relay has read the slot up to what the server has (a relay that stands by
                # claims nothing of this outbox until the slot is dropped).
                return 0
        conn = sessions.take()
        if conn is None:
            return 0
        claim_start = time.time_ns()
        rows = self._claim(lane, conn, limit, None, lane.skip)
        if rows is None:
            return 0
        if wal is not None:
            lane.table.due = len(rows) >= limit
            lane.table.next_claim = time.monotonic() + self.scheduler.jittered_poll()
        if not rows:
            sessions.give_back(conn)
            return 0
        return self._send(lane, _batch(lane, conn, rows), claim_start, limit)

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
                self._went_through(lane, rows)
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
            batch = _batch(lane, conn, rows)
            shared.add(lane.schema, batch)
            self._send(lane, batch, claims.claim_start, limit, flush=False)
            short = short or len(rows) < limit
        if not shared.members:
            sessions.end(conn)
            return counts
        sink = self._sink()
        assert sink is not None
        if short:
            send_now(sink)  # one wait for the acks of them all (see _send)
        sink.poll(0)
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

    def table_news(self, lane: Lane) -> None:
        """WAL capture: rows were inserted into ``lane``'s events table: its table takes its next
        turn (see claim_and_send)."""
        lane.table.due = True

    def give_up_ahead(self) -> None:
        """Claims sent ahead, not read (the relay stops, or lost its connection): rolled back, their
        events pending as they were (none was sent)."""
        claims, self.ahead = self.ahead, None
        if claims is None:
            return
        claims.close()
        self._claim_again(claims.picks)
        self.sessions.roll_back(claims.conn)

    def claim_gate(self, lane: Lane, gate: Gate, most: int) -> int:
        """Events of one limit (--limit) of ``lane``, in a batch of their own: as many as the
        tokens taken from the bucket its relays share allow now, ``most`` at most. None taken:
        the limit waits for its next token; the events wait in the table."""
        sessions = self.sessions
        now = time.monotonic()
        if not sessions.available():
            return 0
        if not CaptureWatch.table_known(lane):  # the capture look failed: the events wait
            gate.next_try = now + GATE_RETRY
            return 0
        try:
            granted, wait = limits.take(self.link.get(), self.membership.id, lane.schema, gate, most)
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                self.link.lost()
            gate.throttle(now, now + GATE_RETRY)
            lane.pause(f"limit {gate.limit.glob}: taking tokens failed: {sessions.clean(exc)}")
            return 0
        if not granted:  # the rate's next token, or (in-flight cap) the next batch to finish
            self._throttled(lane, gate, gate.throttle(now, now + (wait or CAP_RECHECK)))
            return 0
        self._throttled(lane, gate, gate.flowing(now))
        gate.next_try = now
        conn = sessions.take()
        if conn is None:
            return 0
        claim_start = time.time_ns()
        rows = self._claim(lane, conn, granted, gate.only, gate.skip)
        if rows is None:
            return 0
        if len(rows) < granted:
            gate.pending = False  # nothing more of it now: the next NOTIFY, poll or backlog claim
            # The tokens it could not use go back (another relay of the outbox may have the
            # events: its partitions), and its events in flight are what it claimed.
            limits.report(self.link, self.membership.id, lane.schema, gate, len(rows), granted - len(rows))
        if not rows:
            sessions.give_back(conn)
            return 0
        batch = _batch(lane, conn, rows)
        batch.gate = gate
        gate.flying += len(batch)
        gate.batches += 1
        return self._send(lane, batch, claim_start, granted)

    def _throttled(self, lane: Lane, gate: Gate, seconds: float) -> None:
        if seconds and self._metrics_on():
            self.metrics.limit_throttled.inc((lane.name, gate.limit.glob), seconds)

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
        self._went_through(lane, rows)
        return rows

    def _went_through(self, lane: Lane, rows: list[tuple[Any, ...]]) -> None:
        """A claim of ``lane`` went through, empty or not: the database and the outbox answer."""
        self.sessions.database.ok()
        lane.trouble.ok()
        self._progress()
        self.recorder.claim(lane)
        if rows:
            lane.last_work = time.monotonic()

    def _read_and_send(self, lane: Lane, limit: int) -> int:
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
            found: list[tuple[Any, ...]] = []
            if keys and not _one(conn.execute(query("wal_table_quiet", lane.schema)).fetchone()):
                found = conn.execute(query("wal_keys_waiting", lane.schema), {"keys": list(keys)}).fetchall()
        except psycopg.Error as exc:
            lane.wal.rewind()  # read again from the slot
            if isinstance(exc, psycopg.OperationalError):
                sessions.lost(conn, f"WAL batch failed: {sessions.clean(exc)}")
            else:
                self._lane_error(lane, conn, f"WAL batch failed: {sessions.clean(exc)}")
            return 0
        if found:  # held (into the table, behind them) when the key has older events waiting there
            waiting: dict[bytes | None, float] = {row[0]: row[1] for row in found}
            for i, event in enumerate(batch.events):
                if event is not None and waiting.get(event.key, math.inf) <= event.created_at:
                    batch.hold(i)
        lane.last_work = time.monotonic()
        self._progress()
        self.recorder.claim(lane)
        return self._send(lane, batch, claim_start, limit)

    def _send(self, lane: Lane, batch: Batch, claim_start: int, limit: int, flush: bool = True) -> int:
        """Hand a batch's events to the sink (their outcomes come back through ``batch.settle``)."""
        sink = self._sink()
        assert sink is not None
        ordering = lane.ordering
        if batch.expiring:  # before anything else: an expired event is neither sent nor transformed
            batch.expire(time.time())
        if self.transforms:  # before routing: a transform may re-route, re-key or drop an event
            batch.transform(self.transforms)
        batch.spans = tracing.start_batch(
            batch.events, claim_start, time.time_ns(), partial(_span_shape, sink, lane.name)
        )
        self.recorder.sending(lane, len(batch))
        if self._metrics_on():
            self.metrics.batch_size.observe(len(batch), (lane.name,))
        # Per-key order: once an event of key K fails (in this batch or in one
        # still in flight), K's later events are held: left pending, untouched.
        # When the failure is committed, the claim query blocks them instead.
        held = ordering.holds.keys if ordering.ordered else None
        events = batch.events
        start = 0
        chains = self.chains.get(lane.name)
        # A lane with key chains goes through them, event by event: never around them.
        if chains is None and isinstance(sink, ProducesMany) and not held and batch.waiting == len(batch):
            # Nothing held, nothing corrupt: the batch goes to the sink in one call
            # (KafkaSink.produce_many), up to the first event the sink does not take as it is.
            start = sink.produce_many(cast("list[ClaimedEvent]", events), batch.outcomes, batch.settle)
        produce = chains.produce if chains is not None else sink.produce
        for i in range(start, len(events)):
            event = events[i]
            if event is None or batch.outcomes[i] is not None:  # corrupt (dead), or held before
                continue
            if held and (key := batch.key(i)) is not None and key in held:
                batch.hold(i)
                continue
            outcome = produce(event, partial(batch.settle, i))
            if outcome is not None:
                batch.settle(i, outcome)
        self.ledger.sent(lane, batch)
        if not flush:  # one of several batches sent together: the caller sends them
            return len(batch)
        # (WAL capture: a batch cut short by a transaction's end is no sign of an idle outbox
        # while the reader holds a full batch more; "anything waiting" was too broad, as
        # docs/decisions/0004-wal-capture.md says.)
        if len(batch) < limit and not (lane.wal is not None and lane.wal.queued >= limit):
            # No backlog behind this batch, nothing to batch it with: send it without waiting
            # out the client's linger (Kafka). A full batch lingers, and batches on the wire.
            send_now(sink)
        sink.poll(0)  # sinks that queue what they were given send it now, as one burst
        return len(batch)


def _one(row: tuple[Any, ...] | None) -> Any:
    """The value of a one-column row (None: no row)."""
    return None if row is None else row[0]


def _batch(lane: Lane, conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]]) -> Batch:
    """The batch of rows claimed from ``lane`` on ``conn``, with the outbox's key holds."""
    ordering = lane.ordering
    return Batch(conn, rows, holds=ordering.holds if ordering.ordered else None, parks=ordering.parks)


def _span_shape(sink: Sink, outbox: str, topic: str) -> tuple[str, dict[str, Any]]:
    name, attributes = router.shape_of(sink, topic)
    return name, {**attributes, "outbox.name": outbox}
