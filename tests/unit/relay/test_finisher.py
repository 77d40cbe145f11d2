"""outbox.relay.finisher.BatchFinisher and outbox.relay.ledger.Ledger: a batch finished, and the
one place it leaves the loop, built from their collaborators alone, with a session that answers
as scripted (no database)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from outbox.relay.batch import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.finisher import BatchFinisher
from outbox.relay.lanes import Beats, Lane, RelayStats
from outbox.relay.ledger import Ledger
from outbox.relay.metrics import RelayMetrics
from outbox.relay.recorder import BatchRecorder
from outbox.relay.scheduler import ClaimScheduler
from outbox.sinks.base import Delivered
from tests.unit.relay.lanes import a_lane


@dataclass
class _Conn:
    """A batch's session: each statement changes ``rowcount`` rows (fewer than the batch holds
    when its lease was lost)."""

    rowcount: int
    statements: int = 0
    commits: int = 0
    rollbacks: int = 0
    closed: bool = False
    broken: bool = False

    def execute(self, statement: Any, params: Any = None) -> _Conn:
        self.statements += 1
        return self

    def commit(self) -> None:
        self.commits += 1

    def rollback(self) -> None:
        self.rollbacks += 1


@dataclass
class _Sessions:
    back: list[Any] = field(default_factory=list)

    def give_back(self, conn: Any) -> None:
        self.back.append(conn)


def _row(i: int, key: bytes) -> tuple[Any, ...]:
    return (i, str(uuid.uuid4()), "t", key, b"p", None, 1_700_000_000.0, 0, None, None, None, None)


def _finisher(sessions: _Sessions) -> tuple[BatchFinisher, Ledger, BatchRecorder, Lane]:
    config = RelayConfig("postgresql://unused")
    scheduler = ClaimScheduler(config, Beats())
    recorder = BatchRecorder(RelayStats(), RelayMetrics(), lambda: True)
    lane = a_lane("o", "s")
    member = lane.ordering.member
    scheduler.add(lane)
    ledger = Ledger(cast(Any, sessions), cast(Any, None), cast(Any, member), scheduler)
    finisher = BatchFinisher(
        config, cast(Any, sessions), ledger, recorder, lanes=lambda: scheduler.rotation,
        sink=lambda: None, metrics_on=lambda: True, wake=lambda: None,
    )  # fmt: skip
    return finisher, ledger, recorder, lane


def _sent(ledger: Ledger, lane: Lane, conn: _Conn) -> Batch:
    batch = Batch(cast(Any, conn), [_row(1, b"a"), _row(2, b"b")], holds=lane.ordering.holds)
    lane.ordering.holds.add(id(batch), b"a")  # a key this batch holds (as a failure would)
    ledger.sent(lane, batch)
    for i in range(batch.size):
        batch.settle(i, Delivered())
    return batch


def test_a_finished_batch_commits_and_leaves_in_one_place() -> None:
    sessions = _Sessions()
    finisher, ledger, recorder, lane = _finisher(sessions)
    conn = _Conn(rowcount=2)
    _sent(ledger, lane, conn)
    assert ledger.busy == {lane: None} and lane.ordering.holds.keys == {b"a": 1}
    finisher.finish_here(lane, lane.in_flight[0])
    assert (conn.statements, conn.commits) == (1, 1)  # the archive, then the commit
    assert sessions.back == [conn] and not lane.in_flight and not ledger.busy
    assert not lane.ordering.holds.keys  # every key hold released
    assert recorder.stats.delivered == 2 and recorder.stats.leases_lost == 0


def test_a_batch_whose_lease_was_lost_commits_nothing_and_still_leaves_in_one_place() -> None:
    """Its archive changed fewer rows than it holds (another relay took its events): refused
    before the commit, counted as a lease lost, and the batch leaves as any other does."""
    sessions = _Sessions()
    finisher, ledger, recorder, lane = _finisher(sessions)
    conn = _Conn(rowcount=1)
    _sent(ledger, lane, conn)
    finisher.finish_here(lane, lane.in_flight[0])
    assert (conn.commits, conn.rollbacks) == (0, 1)
    assert sessions.back == [conn] and not lane.in_flight and not ledger.busy
    assert not lane.ordering.holds.keys
    assert recorder.stats.delivered == 0 and recorder.stats.leases_lost == 1


def test_the_finisher_has_work_only_for_a_batch_not_handed_over_or_one_finished_since() -> None:
    """BatchFinisher.to_finish, asked at every step: a complete batch not on a finisher is work,
    one on a finisher is not until its thread finished it (then the loop records it), and after
    that look nothing is, until the next batch completes."""
    sessions = _Sessions()
    finisher, ledger, recorder, lane = _finisher(sessions)
    conn = _Conn(rowcount=2)
    assert not finisher.to_finish(ledger.waiting()[1])
    batch = _sent(ledger, lane, conn)
    assert ledger.waiting() == (0, 1) and finisher.to_finish(1)
    finisher.finish_complete()  # handed over to a finisher thread
    future = finisher.finishing[batch][0]
    assert not finisher.to_finish(1) or future.done()  # on its thread: no work until it is done
    future.result(timeout=10)
    assert finisher.to_finish(ledger.waiting()[1])  # finished on its thread: to be recorded
    finisher.finish_complete()
    assert not lane.in_flight and recorder.stats.delivered == 2
    assert not finisher.to_finish(ledger.waiting()[1])
    finisher.shutdown()
