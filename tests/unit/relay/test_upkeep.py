"""outbox.relay.upkeep.capture.CaptureWatch's first looks at an outbox's capture, and the sender's
claim that waits for them: pure logic over the lanes, with sessions that answer (or do not) as
told."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from outbox.relay.claim import TableClaim
from outbox.relay.config import RelayConfig
from outbox.relay.intake import Intake
from outbox.relay.lanes import Beats, Lane
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.upkeep import CaptureWatch, Chores
from outbox.store.outboxes import Outbox


@dataclass
class _Ordering:
    due_at: float = 1e9


class _Conn:
    """A session that answers the database-wide look at slots and publications: none."""

    def __init__(self, asked: list[str]) -> None:
        self.asked = asked

    def execute(self, statement: Any, params: Any = None) -> _Conn:
        self.asked.append("database_slots")
        return self

    def fetchone(self) -> tuple[str, list[str], list[str]]:
        return ("db", [], [])

    def commit(self) -> None:
        pass


@dataclass
class _Sessions:
    up: bool = True  # does the database answer?
    taken: int = 0
    asked: list[str] = field(default_factory=list)

    def take(self) -> _Conn | None:
        self.taken += 1
        return _Conn(self.asked) if self.up else None

    def give_back(self, conn: Any) -> None:
        pass


@dataclass
class _Relay:
    sessions: _Sessions
    scheduler: ClaimScheduler
    capture: CaptureWatch


def _never(*args: Any) -> None:
    raise AssertionError(f"not expected here: {args}")


def _relay(lanes: int, up: bool = True) -> tuple[_Relay, list[Lane]]:
    scheduler = ClaimScheduler(RelayConfig("postgresql://unused"), Beats())
    sessions = _Sessions(up=up)
    watch = CaptureWatch(Chores(cast(Any, sessions), _never), scheduler.rotation, _never)
    relay = _Relay(sessions, scheduler, watch)
    made = []
    for i in range(lanes):
        lane = Lane(Outbox(f"o{i}", "postgresql://unused", f"o{i}"), cast(Any, _Ordering()))
        scheduler.add(lane)
        watch.joined(lane)
        made.append(lane)
    return relay, made


def test_outboxes_that_joined_are_looked_at_before_the_steps_claims_in_one_statement() -> None:
    relay, lanes = _relay(50)
    assert not any(lane.table_known for lane in lanes)  # not claimed before a look
    relay.capture.due(100.0)
    assert all(lane.upkept.capture_mode == "table" and lane.wal is None for lane in lanes)
    assert relay.sessions.asked == ["database_slots"]  # one look for every outbox without a slot
    assert all(lane.table_known for lane in lanes)
    relay.capture.due(101.0)
    assert relay.sessions.asked == ["database_slots"]  # looked at once


def test_a_first_look_that_fails_leaves_the_table_unclaimed_and_is_tried_again_next_step() -> None:
    relay, lanes = _relay(50, up=False)
    relay.capture.due(100.0)
    assert relay.sessions.taken == 1  # the pass stops at the first failure, not 50 tries a step
    assert not any(lane.table_known for lane in lanes)
    relay.sessions.up = True
    relay.capture.due(100.5)
    assert all(lane.table_known for lane in lanes)


def test_a_claim_of_an_outbox_not_looked_at_takes_no_session_and_starts_nothing() -> None:
    """The claim path only asks whether the look was done: the look (and a WAL reader it may
    start) is the upkeep's, in its own part of the step."""
    relay, (lane,) = _relay(1, up=True)
    sessions = cast(Any, relay.sessions)
    table = TableClaim(sessions, send=_never, claimed=_never, lane_error=_never)
    intake = Intake(sessions, relay.scheduler, table, send=_never, flush=_never)
    assert intake.claim_and_send(lane, 100) == 0
    assert relay.sessions.taken == 0 and lane.wal is None and not lane.upkept.capture_mode


class _PartitionsConn:
    """Answers the look at every due outbox's day partitions: ``missing`` lack one."""

    def __init__(self, missing: set[str], asked: list[str]) -> None:
        self.missing = missing
        self.asked = asked
        self._rows: list[tuple[str]] = []

    def execute(self, statement: Any, params: Any = None) -> _PartitionsConn:
        if params is not None and "schemas" in params:
            self.asked.append("partitions_missing")
            self._rows = [(s,) for s in params["schemas"] if s in self.missing]
        else:
            self.asked.append("ensure_partitions")
        return self

    def fetchall(self) -> list[tuple[str]]:
        return self._rows

    def commit(self) -> None:
        pass


@dataclass
class _PartitionSessions:
    missing: set[str]
    asked: list[str] = field(default_factory=list)

    def take(self) -> _PartitionsConn:
        return _PartitionsConn(self.missing, self.asked)

    def give_back(self, conn: Any) -> None:
        pass

    def end(self, conn: Any) -> None:
        pass


def test_the_archive_partitions_of_every_due_outbox_are_asked_about_at_once_and_made_only_where_missing() -> (
    None
):
    from outbox.relay.upkeep import ArchivePartitions
    from outbox.relay.upkeep.partitions import PARTITION_MAINTENANCE

    scheduler = ClaimScheduler(RelayConfig("postgresql://unused"), Beats())
    for i in range(20):
        scheduler.add(Lane(Outbox(f"o{i}", "postgresql://unused", f"o{i}"), cast(Any, _Ordering())))
    sessions = _PartitionSessions(missing={"o3", "o7"})
    partitions = ArchivePartitions(Chores(cast(Any, sessions), _never), scheduler.rotation)
    for step in range(5):
        partitions.due(100.0 + step)
    assert sessions.asked == ["partitions_missing", "ensure_partitions", "ensure_partitions"]
    assert partitions.next_at() == 100.0 + PARTITION_MAINTENANCE  # the next hourly check
