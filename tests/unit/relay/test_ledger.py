"""outbox.relay.ledger.Ledger: the one place a batch leaves, built from its collaborators alone
(sessions that count what comes back, a WAL reader that records what it was told; no database)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from outbox.events import ClaimedEvent
from outbox.relay.batch import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Beats, Lane
from outbox.relay.ledger import Ledger
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.wal_batch import WalBatch
from tests.unit.relay.lanes import a_lane


@dataclass
class _Sessions:
    back: list[Any] = field(default_factory=list)

    def give_back(self, conn: Any) -> None:
        self.back.append(conn)


@dataclass
class _Reader:
    """What the ledger tells a lane's WAL reader."""

    told: list[Any] = field(default_factory=list)

    def confirm(self, position: Any) -> None:
        self.told.append(("confirm", position))

    def rewind(self) -> None:
        self.told.append("rewind")


def _lane() -> tuple[Ledger, Lane, _Sessions, ClaimScheduler]:
    config = RelayConfig("postgresql://unused")
    scheduler = ClaimScheduler(config, Beats())
    lane = a_lane("o", "s")
    member = lane.ordering.member
    scheduler.add(lane)
    sessions = _Sessions()
    return (
        Ledger(cast(Any, sessions), cast(Any, None), cast(Any, member), scheduler),
        lane,
        sessions,
        scheduler,
    )


def _wal_batch(conn: object, position: int) -> WalBatch:
    event = ClaimedEvent(0, str(uuid.uuid4()), "t", b"k", b"p", (), 1_700_000_000.0, 0)
    return WalBatch(cast(Any, conn), [(event, None)], cast(Any, position))


def test_a_batch_leaves_once_with_its_session_its_holds_and_its_retry_time() -> None:
    ledger, lane, sessions, _ = _lane()
    row = (1, str(uuid.uuid4()), "t", b"a", b"p", None, 1_700_000_000.0, 0, None, None, None, None)
    batch = Batch(cast(Any, "conn"), [row], holds=lane.ordering.holds)
    lane.ordering.holds.add(id(batch), b"a")
    ledger.sent(lane, batch)
    assert ledger.busy == {lane: None} and ledger.flights() == [(lane, batch)]
    assert ledger.done(lane, batch, retry_in=5.0) == []
    assert sessions.back == ["conn"] and not ledger.busy and not lane.in_flight
    assert not lane.ordering.holds.keys and lane.retry_at < float("inf")
    assert ledger.done(lane, batch) == [] and sessions.back == ["conn"]  # gone already: nothing twice


def test_a_wal_batch_that_committed_confirms_its_position_and_one_that_did_not_rewinds() -> None:
    """One that did not commit is read again from the slot, and so is every WAL batch read after
    it: the ledger hands those back for the caller to release once their finishers gave up."""
    ledger, lane, sessions, _ = _lane()
    reader = _Reader()
    lane.wal = cast(Any, reader)
    first, second, third = (_wal_batch(f"c{i}", i) for i in (1, 2, 3))
    for batch in (first, second, third):
        ledger.sent(lane, batch)
    first.finished = True
    assert ledger.done(lane, first) == [] and reader.told == [("confirm", 1)]
    later = ledger.done(lane, second)  # not committed
    assert reader.told[-1] == "rewind" and later == [third]
    assert lane.in_flight == [third]  # the caller's to release
    ledger.leave(lane, third)
    assert sessions.back == ["c1", "c2", "c3"] and not ledger.busy


def test_a_batch_whose_lease_ran_out_makes_the_next_claims_smaller() -> None:
    ledger, lane, _, scheduler = _lane()
    rows = [(i, str(uuid.uuid4()), "t", None, b"p", None, 1.0, 0, None, None, None, None) for i in range(400)]
    batch = Batch(cast(Any, "conn"), rows)
    ledger.sent(lane, batch)
    ledger.done(lane, batch, paced=(True, batch.claimed_at + 60.0))
    assert 0 < lane.pace.cap < scheduler.config.batch_size
