"""outbox.relay.gated.GateIntake and outbox.relay.wal_intake.WalIntake: a limit's claims as its
tokens allow, and a WAL lane's turns between its slot and its table, with a link that grants
tokens as told, a table claim that finds rows as told, and a WAL reader that holds batches (no
database)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import psycopg

from outbox.relay.batch import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.gated import GateIntake
from outbox.relay.lanes import Beats, Lane
from outbox.relay.limits import Limit, gates
from outbox.relay.metrics import RelayMetrics
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.wal_intake import WalIntake
from tests.unit.relay.lanes import a_lane


@dataclass
class _Conn:
    """The link's session: answers each token request with ``grants`` in turn; reports count."""

    grants: list[tuple[int, float]]
    reports: int = 0

    def execute(self, statement: Any, params: Any = None) -> _Conn:
        if "back" in params:
            self.reports += 1
        return self

    def fetchone(self) -> tuple[int, float]:
        return self.grants.pop(0)


@dataclass
class _Table:
    """TableClaim: each claim finds ``rows`` of the limit asked (a session 'conn' each time)."""

    found: int
    asked: list[tuple[int, str | None]] = field(default_factory=list)
    back: int = 0

    def claim(self, lane: Lane, limit: int, only: str | None, skip: str | None) -> Any:
        self.asked.append((limit, only))
        n = min(self.found, limit)
        rows = [
            (i, str(uuid.uuid4()), "orders.new", None, b"p", None, 1.0, 0, None, None, None, None)
            for i in range(n)
        ]
        return ("conn", rows, 0)

    def hand_on(self, lane: Lane, claimed: Any, limit: int) -> int:
        return len(claimed[1])

    def went_through(self, lane: Lane, events: int) -> None:
        pass


def _lane() -> Lane:
    lane = a_lane("o", "s")
    lane.upkept.capture_mode = "table"
    return lane


def _gated(grants: list[tuple[int, float]], found: int) -> tuple[GateIntake, _Table, _Conn, list[Batch]]:
    conn = _Conn(grants)
    link = SimpleNamespace(get=lambda: conn, lost=lambda: None)
    sessions = SimpleNamespace(available=lambda: True, give_back=lambda c: None, clean=str)
    sent: list[Batch] = []

    def send(lane: Lane, batch: Batch, start: int, limit: int, flush: bool) -> int:
        sent.append(batch)
        return batch.size

    table = _Table(found)
    member = SimpleNamespace(id="me")
    gated = GateIntake(
        cast(Any, sessions), cast(Any, link), cast(Any, member), cast(Any, table), RelayMetrics(),
        send=send, metrics_on=lambda: True,
    )  # fmt: skip
    return gated, table, conn, sent


def test_a_limit_claims_no_more_than_its_tokens_and_gives_back_what_it_could_not_use() -> None:
    gated, table, conn, sent = _gated([(5, 0.0)], found=3)
    lane = _lane()
    (gate,) = lane.gates = gates([Limit("orders.*", rate=10.0, in_flight=None)])
    assert gated.claim_gate(lane, gate, most=100) == 3
    assert table.asked == [(5, gate.only)]  # the tokens granted, not the batch size
    assert sent[0].gate is gate and gate.flying == 3 and gate.batches == 1
    assert conn.reports == 1 and not gate.pending  # two tokens back; nothing more of it now


def test_a_limit_without_tokens_claims_nothing_and_waits_for_the_next() -> None:
    gated, table, _, sent = _gated([(0, 0.4)], found=3)
    lane = _lane()
    (gate,) = lane.gates = gates([Limit("orders.*", rate=10.0, in_flight=None)])
    assert gated.claim_gate(lane, gate, most=100) == 0
    assert table.asked == [] and sent == [] and gate.next_try > 0 and gate.throttled_since > 0


def test_a_limit_whose_tokens_cannot_be_taken_rests_its_outbox() -> None:
    gated, _, conn, _ = _gated([], found=3)
    conn.fetchone = lambda: (_ for _ in ()).throw(psycopg.errors.UndefinedTable("no such table"))  # type: ignore[method-assign]
    lane = _lane()
    (gate,) = lane.gates = gates([Limit("orders.*", rate=10.0, in_flight=None)])
    assert gated.claim_gate(lane, gate, most=100) == 0
    assert lane.trouble.active and "taking tokens failed" in lane.trouble.last_error


@dataclass
class _Reader:
    """A WAL reader with a transaction always waiting."""

    waiting: bool = True
    taken: int = 0
    queued: int = 0
    reading: bool = True
    caught_up: bool = True

    def take(self, limit: int) -> None:
        self.taken += 1  # nothing to send after all: the session goes back
        return None

    def rewind(self) -> None:
        pass


def test_a_wal_lane_takes_turns_between_its_slot_and_a_table_with_news() -> None:
    lane = _lane()
    reader = _Reader()
    lane.wal = cast(Any, reader)
    table = _Table(found=1)
    sessions = SimpleNamespace(take=lambda: "conn", give_back=lambda c: None)
    wal = WalIntake(
        cast(Any, sessions), ClaimScheduler(RelayConfig("postgresql://unused"), Beats()), cast(Any, table),
        send=lambda *a: 0, lane_error=lambda *a: None,
    )  # fmt: skip
    lane.table.next_claim = float("inf")  # the table's poll is far off, and it has no news
    lane.table.due = False
    for _ in range(4):
        wal.claim_and_send(lane, 100)
    assert reader.taken == 4 and table.asked == []  # no news of the table: the slot every time
    wal.table_news(lane)
    for _ in range(2):
        wal.claim_and_send(lane, 100)
    assert reader.taken == 5 and len(table.asked) == 1  # one turn each
    assert not lane.table.due  # a claim short of its limit: the table waits for news again
