"""outbox.relay.roster.Roster: outboxes join and leave the relay, built from its collaborators alone
(a membership whose link answers as told, a listener that records its channels; no database)."""

from __future__ import annotations

import logging
import threading
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from outbox.errors import ConfigError
from outbox.observe.conditions import Condition
from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Beats, Lane
from outbox.relay.metrics import RelayMetrics
from outbox.relay.roster import Roster
from outbox.relay.scheduler import ClaimScheduler
from outbox.sinks.chains import KeyChains
from outbox.store.outboxes import Outbox
from outbox.store.schema import channel_name

DSN = "postgresql://relay@db.example/orders"


@dataclass
class _Link:
    """The membership's connection: records the statements (a partition hand-over)."""

    statements: list[Any] = field(default_factory=list)

    def get(self) -> _Link:
        return self

    def execute(self, statement: Any, params: Any = None) -> None:
        self.statements.append(params)

    def lost(self) -> None:
        raise AssertionError("no statement fails here")


@dataclass
class _Listener:
    watched: dict[str, Any] = field(default_factory=dict)

    def watch(self, channel: str, callback: Any) -> None:
        self.watched[channel] = callback

    def unwatch(self, channel: str) -> None:
        del self.watched[channel]


@dataclass
class _World:
    roster: Roster
    scheduler: ClaimScheduler
    lanes: dict[str, Lane]
    chains: dict[str, KeyChains]
    listener: _Listener
    link: _Link
    membership: Any
    asked: list[str]
    woken: list[int]


def _world(outboxes: list[Outbox], *, sink: bool = True) -> _World:
    config = RelayConfig(DSN)
    beats = Beats()
    scheduler = ClaimScheduler(config, beats)
    link = _Link()
    membership = SimpleNamespace(id=uuid.uuid4(), link=link, changed=False)
    lanes: dict[str, Lane] = {}
    chains: dict[str, KeyChains] = {}
    listener = _Listener()
    asked: list[str] = []
    woken: list[int] = []
    log = logging.getLogger("test")
    roster = Roster(
        config, cast(Any, membership), scheduler, RelayMetrics(), lanes, beats, chains, outboxes,
        outages=[Condition(log, "database", "d"), Condition(log, "stall", "s")],
        running=threading.Event(),
        sink=lambda: cast(Any, object()) if sink else None,
        listener=lambda: cast(Any, listener),
        wake=lambda: woken.append(1),
        joined=lambda lane: asked.append(f"joined {lane.name}"),
        chain=lambda lane: asked.append(f"chain {lane.name}"),
        stop_reader=lambda lane: asked.append(f"stop reader {lane.name}"),
    )  # fmt: skip
    return _World(roster, scheduler, lanes, chains, listener, link, membership, asked, woken)


def test_outboxes_join_at_the_next_step_each_a_lane_looked_at_chained_and_listened_to() -> None:
    a, b = Outbox("a", DSN, "sa"), Outbox("b", DSN, "sb")
    w = _world([a, b])
    assert w.roster.changed and not w.lanes  # not before the loop's step
    w.roster.apply()
    assert not w.roster.changed
    assert set(w.lanes) == {"a", "b"} and [lane.name for lane in w.scheduler.rotation] == ["a", "b"]
    assert w.asked == ["joined a", "chain a", "joined b", "chain b"]
    assert set(w.listener.watched) == {channel_name("sa"), channel_name("sb")}
    for lane in w.lanes.values():
        lane.wake.woken = False  # a lane joins woken (its first claim at once): taken
    w.listener.watched[channel_name("sb")]()  # a NOTIFY on b's channel: b claims at the next step
    assert w.lanes["b"].wake.woken and not w.lanes["a"].wake.woken and w.woken == [1]
    database, _ = w.roster._outages
    assert database.description == "outboxes a, b: cannot reach PostgreSQL"


def test_an_outbox_no_longer_served_leaves_once_its_batches_are_done() -> None:
    a, b = Outbox("a", DSN, "sa"), Outbox("b", DSN, "sb")
    w = _world([a, b])
    w.roster.apply()
    lane = w.lanes["b"]
    lane.in_flight.append(cast(Any, SimpleNamespace()))  # a batch of b out
    w.roster.serve([a])
    w.roster.apply()
    assert lane.leaving and "b" in w.lanes and channel_name("sb") in w.listener.watched
    assert w.link.statements == []  # its partitions are kept while its batch is out
    lane.in_flight.clear()
    w.roster.forget_left()
    assert "b" not in w.lanes and lane not in w.scheduler.rotation
    assert w.asked[-1] == "stop reader b" and channel_name("sb") not in w.listener.watched
    assert w.link.statements == [{"me": w.membership.id}]  # its partitions handed over
    assert w.membership.changed  # the other relays of its outbox look at it again


def test_an_outbox_served_again_before_it_left_stays() -> None:
    a = Outbox("a", DSN, "sa")
    w = _world([a])
    w.roster.apply()
    lane = w.lanes["a"]
    lane.in_flight.append(cast(Any, SimpleNamespace()))
    w.roster.serve([])
    w.roster.apply()
    assert lane.leaving
    w.roster.serve([a])
    w.roster.apply()
    assert not lane.leaving and w.lanes["a"] is lane


def test_a_name_that_now_means_another_schema_leaves_first_and_joins_anew() -> None:
    w = _world([Outbox("a", DSN, "sa")])
    w.roster.apply()
    old = w.lanes["a"]
    w.roster.serve([Outbox("a", DSN, "sa2")])
    w.roster.apply()  # the old one had nothing in flight: gone in the same step
    assert "a" not in w.lanes and old not in w.scheduler.rotation
    w.roster.serve([Outbox("a", DSN, "sa2")])  # discovery serves it again
    w.roster.apply()
    assert w.lanes["a"].schema == "sa2" and channel_name("sa2") in w.listener.watched


def test_a_relay_serves_one_database_and_says_so_in_one_line() -> None:
    w = _world([Outbox("a", DSN, "sa")])
    w.roster.apply()
    with pytest.raises(ConfigError, match="one database; run one per database"):
        w.roster.serve([Outbox("b", "postgresql://relay@other.example/orders", "sb")])


def test_without_a_sink_yet_a_joining_outbox_is_not_chained() -> None:
    w = _world([Outbox("a", DSN, "sa")], sink=False)
    w.roster.apply()
    assert w.asked == ["joined a"]
