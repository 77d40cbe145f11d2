"""A claimed batch: its row locks are the lease, its commit is the fenced ack.

The relay claims a batch with ``SELECT … FOR UPDATE SKIP LOCKED`` and keeps
that transaction open while the sink works. The row locks mark the owner: no
other worker can claim these events until the transaction ends. The relay's
connections run with ``idle_in_transaction_session_timeout = lease``, so a
worker that stalls past its lease has its session ended by PostgreSQL itself,
its locks released, and its later ack refused (the connection is gone) — it
cannot archive, retry or dead-letter anything after that. Every state change
also checks the number of rows it really changed.

``finish`` writes every outcome and returns a :class:`BatchResult`: what the
batch did, per topic, from which the relay records its spans and metrics once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Any, ClassVar, cast

import psycopg

from outbox.errors import CorruptEvent, FencingError
from outbox.events import (
    COMMITTED_OF,
    CORRUPT_TOPIC,
    TOPIC_OF,
    ClaimedEvent,
    decode_row,
    time_text,
)
from outbox.relay.limits import Gate
from outbox.relay.ordering import Failure, KeyHolds
from outbox.relay.retry import RetryPolicy, cap_error
from outbox.sinks.base import CORRUPT_EVENT, EXPIRED, HELD, Dead, Delivered, Outcome, Retry
from outbox.store import finishing
from outbox.store.finishing import Written
from outbox.transform import TRANSFORM_FAILED, Transforms
from outbox.transform.spec import TransformFailed

# Delivered's fields as C-level getters, for map() over a finished batch.
_PARTITION, _OFFSET, _REF = (itemgetter(Delivered._fields.index(f)) for f in ("partition", "offset", "ref"))
_ID, _ATTEMPTS, _EXPIRES = itemgetter(0), itemgetter(7), itemgetter(10)  # of a claimed row (claim_batch's)


# psycopg's pipeline mode needs libpq 14+ (the binary wheels bring their own; a system libpq
# may be older): without it, each statement is its own round trip.
PIPELINE = psycopg.Pipeline.is_supported()


@dataclass(slots=True)
class TopicResult:
    """What a finished batch did with its events of one topic."""

    delivered: int = 0
    filtered: dict[str, int] = field(default_factory=dict)  # transform -> events it dropped
    retried: int = 0
    dead: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # error kind -> failed attempts
    # Seconds to the ack per delivery, from the commit where PostgreSQL keeps it (ClaimedEvent.
    # committed_at), else from the creation; only when asked for (metrics are on).
    latencies: list[float] = field(default_factory=list)  # from the creation
    commit_latencies: list[float] = field(default_factory=list)  # from the commit


def _latency(result: TopicResult, event: ClaimedEvent, now: float) -> None:
    """One delivery's latency, from its commit where known, else from its creation."""
    if event.committed_at is not None:
        result.commit_latencies.append(now - event.committed_at)
    else:
        result.latencies.append(now - event.created_at)


@dataclass(slots=True)
class BatchResult:
    """What finishing a batch did: per topic, and the dead letters it made (for the log)."""

    topics: dict[str, TopicResult] = field(default_factory=dict)
    dead_events: list[tuple[int, str]] = field(default_factory=list)  # (id, reason)
    next_retry: float | None = None  # seconds to the soonest retry it scheduled (None: none)
    # (event_id, the event_id it overtook): delivered while an earlier event of its key, sent
    # before it, is to be retried (KeyHolds.overtaken): per-key order broken.
    overtaken: list[tuple[str, str]] = field(default_factory=list)

    @property
    def delivered(self) -> int:
        return sum(t.delivered for t in self.topics.values())

    @property
    def retried(self) -> int:
        return sum(t.retried for t in self.topics.values())

    @property
    def dead(self) -> int:
        return sum(t.dead for t in self.topics.values())


class Batch:
    """Events claimed in one transaction on one connection, and their outcomes."""

    made = 0  # the number of the last batch made (the loop's thread makes them)
    # Read from a WAL slot (WalBatch): a lane's such batches commit one at a time, in the order read.
    from_wal: ClassVar[bool] = False

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        rows: list[tuple[Any, ...]],
        *,
        holds: KeyHolds | None = None,
        parks: bool = False,
    ) -> None:
        self._start(conn, list(map(_ID, rows)), list(map(_ATTEMPTS, rows)), holds, parks)
        self.expiring = any(map(_EXPIRES, rows))
        try:
            self.events: list[ClaimedEvent | None] = list(map(decode_row, rows))
        except CorruptEvent:  # at least one: decode row by row, settling each corrupt one
            self.events = []
            for i, row in enumerate(rows):
                try:
                    self.events.append(decode_row(row))
                except CorruptEvent as exc:
                    self.events.append(None)
                    self.corrupt += 1
                    reason = f"corrupt event row: {exc}" if exc.kind == CORRUPT_EVENT else str(exc)
                    self.settle(i, Dead(exc.kind, reason))

    def _start(
        self,
        conn: psycopg.Connection[Any],
        ids: list[int],
        attempts: list[int],
        holds: KeyHolds | None,
        parks: bool,
    ) -> None:
        """Everything but the events: their ids and attempts, no outcome yet."""
        self.conn = conn
        # Ordered mode: a failure of key K holds K's later events until this batch ends.
        self._holds = holds
        self._parks = parks  # ... and so does a dead letter (--on-dead park)
        self.ids = ids
        self.size = len(ids)
        self.attempts = attempts
        # One slot per event, None until its outcome is known. A sink may store a Delivered
        # straight into its slot (KafkaSink.produce_many); every other outcome goes through
        # settle(), which also holds the event's key.
        self.outcomes: list[Outcome | None] = [None] * len(ids)
        self.claimed_at = time.monotonic()
        Batch.made += 1
        self.seq = Batch.made  # the order the relay sends its batches in
        self.gate: Gate | None = None  # the limit (--limit) it was claimed for, if any
        self.abandoned = False
        self.finished = False  # its outcomes committed
        # The transaction it shares with other outboxes' batches, claimed in one round trip and
        # committed once (None: a transaction of its own).
        self.shared: Shared | None = None
        self.settled_at: float | None = None  # a shared one: when the loop first saw it complete
        # OpenTelemetry "send <topic>" spans of this batch (empty when tracing is off).
        self.spans: dict[str, Any] = {}
        self.corrupt = 0  # rows that could not be decoded (settled as dead at once)
        self.expiring = False  # some event has an expiry (Batch.expire)
        self.events = []
        # A transform's work: the events it dropped (index -> the transform, their outcome a
        # Delivered), and the keys the events it re-keyed had (index -> the stored key), which
        # holds and parks go by: the table's claims know only those.
        self.filtered: dict[int, str] = {}
        self.stored_keys: dict[int, bytes | None] = {}

    def key(self, index: int) -> bytes | None:
        """The stored key of event ``index`` (a transform may send it under another)."""
        event = self.events[index] if index < len(self.events) else None
        if event is None:
            return None
        return self.stored_keys.get(index, event.key) if self.stored_keys else event.key

    def expire(self, now: float) -> None:
        """Each event not settled yet whose expiry is at or before ``now`` (its claim), dead with
        the kind ``expired``: not sent, and its key not held (settle)."""
        events = self.events
        outcomes = self.outcomes
        for i, event in enumerate(events):
            if event is None or outcomes[i] is not None or event.expires_at is None:
                continue
            if event.expires_at <= now:  # -infinity too (a writer's own SQL may store it)
                at, claimed = time_text(event.expires_at), time_text(now)
                why = f"expires_at {at} passed before it was sent (claimed at {claimed})"
                self.settle(i, Dead(EXPIRED, why))

    def transform(self, transforms: Transforms) -> None:
        """Each event not settled yet through the transform of its topic, if any: replaced by
        what it returned, dropped (None), or dead (it raised, or returned no valid event)."""
        events = self.events
        outcomes = self.outcomes
        of = transforms.of
        for i, event in enumerate(events):
            if event is None or outcomes[i] is not None:
                continue
            t = of(event.topic)
            if t is None:
                continue
            try:
                after = t.run(event)
            except TransformFailed as exc:
                self.settle(i, Dead(TRANSFORM_FAILED, str(exc)))
                continue
            if after is None:
                self.filtered[i] = t.text
                outcomes[i] = FILTERED
            elif after is not event:
                if after.key != event.key:
                    self.stored_keys[i] = event.key
                events[i] = after

    @property
    def waiting(self) -> int:
        """Events whose outcome is not known yet."""
        return self.outcomes.count(None)

    def settle(self, index: int, outcome: Outcome) -> None:
        """Record the outcome of event ``index`` (called once per event)."""
        if self.abandoned or self.outcomes[index] is not None:
            return
        self.outcomes[index] = outcome
        if type(outcome) is Delivered or self._holds is None:  # hot path first
            return
        # A held event stays locked here, untouched, until this batch ends, and a claim skips
        # locked rows. The failure it waits behind blocks its key in the claim only while that
        # failed event waits in the table: retried and delivered meanwhile (or never committed:
        # its batch lost its lease), the key's later events were claimed and went out ahead of
        # this one. So claims skip the key's events after it until this batch ends. (A WAL
        # batch's held event is not in the table until this batch commits: its key is held.)
        if outcome is HELD or isinstance(outcome, Retry) or (self._parks and not _expired(outcome)):
            key = self.key(index)
            if key is not None:
                locked = self._locked_id(index) if outcome is HELD else None
                self._holds.add(id(self), key, locked=locked)
                if isinstance(outcome, Retry):
                    event_id = self.events[index].event_id  # type: ignore[union-attr]
                    failure = Failure(event_id, self.seq, index, Batch.made, time.monotonic())
                    self._holds.failed(key, failure)

    def _locked_id(self, index: int) -> int | None:
        """The table id of event ``index``, locked by this batch until it ends."""
        return self.ids[index]

    def hold(self, index: int) -> None:
        """Leave event ``index`` untouched: an earlier event of its key failed and is not committed."""
        self.settle(index, HELD)

    @property
    def complete(self) -> bool:
        return None not in self.outcomes

    def finish(
        self, schema: str, policy: RetryPolicy, *, archive: bool, latencies: bool = True
    ) -> BatchResult:
        """Write every outcome in one transaction (one statement per kind) and commit;
        ``latencies``: list each delivery's creation-to-ack time in the result.

        Raises FencingError (after rolling back) if a statement changed other
        rows than expected, and psycopg.OperationalError if the lease was lost.
        """
        result, written = self._written(policy, archive=archive, latencies=latencies)
        try:
            self._write_and_commit(schema, written)
            self.finished = True
        except FencingError:
            self.conn.rollback()
            raise
        return result

    def stage(
        self, schema: str, policy: RetryPolicy, *, archive: bool, latencies: bool = True
    ) -> BatchResult:
        """Write every outcome in the transaction, without committing it: a batch that shares its
        transaction with other outboxes' batches (:class:`outbox.shared.Shared`), committed once
        for all of them. Raises as :meth:`finish` does, without rolling back."""
        result, written = self._written(policy, archive=archive, latencies=latencies)
        self._write(schema, written)
        return result

    def _written(self, policy: RetryPolicy, *, archive: bool, latencies: bool) -> tuple[BatchResult, Written]:
        """What finishing writes: the result, and the statements' lists."""
        result = BatchResult()
        topics = result.topics
        now = time.time()
        ok_ids: list[int] = []
        ok_parts: list[int | None] = []
        ok_offsets: list[int | None] = []
        ok_refs: list[str | None] = []
        ok_filtered: list[str | None] = []
        filtered = self.filtered
        retry_ids: list[int] = []
        retry_delays: list[float] = []
        retry_errors: list[str] = []
        retry_kinds: list[str] = []
        dead_ids: list[int] = []
        dead_errors: list[str] = []
        dead_kinds: list[str] = []
        outcomes = self.outcomes
        if self._holds is not None and self._holds.failures:
            result.overtaken = self._overtaken()
        if not filtered and set(map(type, outcomes)) == {Delivered}:
            # The common case, every event delivered: the lists come from map() and one
            # comprehension, not from the per-outcome loop below (a cost per event).
            events = cast("list[ClaimedEvent]", self.events)  # none is corrupt: a corrupt row is dead
            delivered = cast("list[Delivered]", outcomes)
            ok_ids = self.ids
            ok_parts = list(map(_PARTITION, delivered))
            ok_offsets = list(map(_OFFSET, delivered))
            ok_refs = list(map(_REF, delivered))
            names = set(map(TOPIC_OF, events))
            if len(names) == 1:
                only = topics[names.pop()] = TopicResult(delivered=len(events))
                if latencies:  # from the commit where it is known, else from the creation
                    committed = list(map(COMMITTED_OF, events))
                    only.commit_latencies = [now - c for c in committed if c is not None]
                    if len(only.commit_latencies) < len(events):
                        pairs = zip(events, committed, strict=True)
                        only.latencies = [now - e.created_at for e, c in pairs if c is None]
            else:
                for e in events:
                    tr = topics.get(e.topic)
                    if tr is None:
                        tr = topics[e.topic] = TopicResult()
                    tr.delivered += 1
                    if latencies:
                        _latency(tr, e, now)
            outcomes = []  # nothing left for the loop below
        for i, outcome in enumerate(outcomes):
            if outcome is None or outcome is HELD:  # held: left pending, untouched
                continue
            event = self.events[i]
            topic = CORRUPT_TOPIC if event is None else event.topic
            tr = topics.get(topic)
            if tr is None:
                tr = topics[topic] = TopicResult()
            if type(outcome) is Delivered:
                ok_ids.append(self.ids[i])
                ok_parts.append(outcome.partition)
                ok_offsets.append(outcome.offset)
                ok_refs.append(outcome.ref)
                if filtered:
                    ok_filtered.append(filtered.get(i))
                    if i in filtered:
                        tr.filtered[filtered[i]] = tr.filtered.get(filtered[i], 0) + 1
                        continue
                tr.delivered += 1
                if latencies:
                    _latency(tr, event, now)  # type: ignore[arg-type]
                continue
            assert isinstance(outcome, (Retry, Dead))
            tr.errors[outcome.kind] = tr.errors.get(outcome.kind, 0) + 1
            if isinstance(outcome, Retry):
                made = self.attempts[i] + 1
                if not policy.exhausted(made):
                    retry_ids.append(self.ids[i])
                    delay = policy.next_delay(made)
                    if outcome.delay is not None:  # the sink asked for more (Retry-After)
                        delay = max(delay, min(outcome.delay, policy.cap))
                    retry_delays.append(delay)
                    retry_errors.append(cap_error(outcome.reason))
                    retry_kinds.append(outcome.kind)
                    tr.retried += 1
                    continue
                reason = cap_error(f"gave up after {made} attempts: {outcome.reason}")
            else:
                reason = cap_error(outcome.reason)
            dead_ids.append(self.ids[i])
            dead_errors.append(reason)
            dead_kinds.append(outcome.kind)
            tr.dead += 1
            result.dead_events.append((self.ids[i], reason))

        if retry_delays:
            result.next_retry = min(retry_delays)
        written = Written(
            archive, ok_ids, ok_parts, ok_offsets, ok_refs, ok_filtered,
            retry_ids, retry_delays, retry_errors, retry_kinds,
            dead_ids, dead_errors, dead_kinds, result.dead_events,
        )  # fmt: skip
        return result, written

    def _overtaken(self) -> list[tuple[str, str]]:
        """Each delivered event that went ahead of an earlier event of its key to be retried."""
        assert self._holds is not None
        found = []
        for i, outcome in enumerate(self.outcomes):
            event = self.events[i]
            key = self.key(i)
            if (
                type(outcome) is Delivered
                and event is not None
                and key is not None
                and i not in self.filtered
            ):
                earlier = self._holds.overtaken(key, self.seq, i)
                if earlier is not None:
                    found.append((event.event_id, earlier.event_id))
        return found

    def _write_and_commit(self, schema: str, w: Written) -> None:
        """The outcomes' statements and the commit. Each statement's row count is checked
        before the commit (a lost lease changes fewer rows): one round trip each."""
        self._write(schema, w)
        self.conn.commit()

    def _write(self, schema: str, w: Written) -> None:
        """The outcomes' statements, in the batch's transaction (committed by ``finish``)."""
        finishing.write(self.conn, schema, w, parks=self._parks)

    def release(self) -> None:
        """Give the batch up: roll back so its events can be claimed again at once."""
        self.abandoned = True
        with contextlib.suppress(psycopg.Error):  # if the connection is gone, so are the locks
            self.conn.rollback()


FILTERED = Delivered()  # the outcome of an event a transform dropped: archived (Batch.filtered)


class RolledBack(Exception):
    """A batch's outcomes were not committed: the transaction it shared failed for another
    outbox's batch. Its events stay pending, as after any failed ack."""


class Shared:
    """A transaction that batches of several outboxes of one database share: claimed in one round
    trip (pipelined), sent together, committed once. Short claims of many outboxes each cost a
    transaction, a session and an ack wait of their own otherwise; a relay draining a thousand
    outboxes spent most of its loop on those. Every member's row locks last until the commit, so
    each member is a lease like any batch; the price is that a failure of one member's statements
    rolls back every member (their events stay pending and are sent again: duplicates, never a
    loss)."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.members: list[tuple[str, Batch]] = []  # (schema, batch), in the order claimed
        self.left = 0  # members not done yet: the last one gives the session back
        self.handed = False  # on a finisher (or finished on the loop)

    def add(self, schema: str, batch: Batch) -> None:
        batch.shared = self
        self.members.append((schema, batch))
        self.left += 1

    @property
    def complete(self) -> bool:
        return all(batch.complete for _, batch in self.members)

    def finish(
        self, policy: RetryPolicy, *, archive: bool, latencies: bool = True
    ) -> dict[Batch, BatchResult | Exception]:
        """Every member's statements, then one commit. Each member's result, or what stopped it:
        the error for the member whose statement failed (every member's, when the commit did),
        :class:`RolledBack` for the others."""
        results: dict[Batch, BatchResult | Exception] = {}
        failed: Batch | None = None
        try:
            for schema, batch in self.members:
                failed = batch
                results[batch] = batch.stage(schema, policy, archive=archive, latencies=latencies)
            failed = None
            self.conn.commit()
        except (FencingError, psycopg.Error) as exc:
            if self.conn.closed or self.conn.broken:  # the session is gone: every member's lease with it
                failed = None
            with contextlib.suppress(psycopg.Error):
                self.conn.rollback()
            culprit = next((s for s, b in self.members if b is failed), None)
            others = RolledBack(f"rolled back with the batch of schema {culprit}: {exc}")
            return {b: exc if failed is None or b is failed else others for _, b in self.members}
        for _, batch in self.members:
            batch.finished = True
        return results


def _expired(outcome: Outcome) -> bool:
    return type(outcome) is Dead and outcome.kind == EXPIRED
