"""outbox.relay.upkeep.sinks.SinkUpkeep: an unhealthy sink replaced, key chains where a sink cannot
keep a key's order, sinks probed while down, and an outage's failures made due at once when they
answer again; built from its collaborators alone (sinks and a session that answer as told)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

from outbox.relay.config import RelayConfig
from outbox.relay.lanes import Beats, Lane, RelayStats
from outbox.relay.metrics import RelayMetrics
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.upkeep.sinks import RETRIES_PER_STEP, SinkUpkeep
from outbox.sinks.chains import KeyChains
from tests.unit.relay.lanes import a_lane


@dataclass
class _Sink:
    """A sink whose broker is down until told otherwise (Reachable), and that may not keep a
    key's order (KeyOrder)."""

    name: str = "fake"
    keeps_key_order: bool = True
    down: str | None = None
    probes: int = 0
    closed: list[float] = field(default_factory=list)

    def trouble(self) -> str | None:
        return self.down

    def probe(self) -> None:
        self.probes += 1

    def close(self, timeout: float) -> None:
        self.closed.append(timeout)


@dataclass
class _Chores:
    """Runs a lane's statement on a session whose statements change ``rows`` rows."""

    rows: int = 3
    ran: list[str] = field(default_factory=list)

    def on_session(self, lane: Lane, what: str, work: Any) -> Any:
        self.ran.append(lane.name)
        return work(self)

    def execute(self, statement: Any, params: Any = None) -> _Chores:
        return self

    @property
    def rowcount(self) -> int:
        return self.rows


@dataclass
class _World:
    upkeep: SinkUpkeep
    scheduler: ClaimScheduler
    stats: RelayStats
    chores: _Chores
    chains: dict[str, KeyChains]
    current: list[Any]
    made: list[_Sink]
    asked: list[str]


def _world(lanes: list[Lane], *, ordered_sinks: bool = True) -> _World:
    scheduler = ClaimScheduler(RelayConfig("postgresql://unused"), Beats())
    for lane in lanes:
        scheduler.add(lane)
    stats = RelayStats()
    chores = _Chores()
    chains: dict[str, KeyChains] = {}
    current: list[Any] = [None]
    made: list[_Sink] = []
    asked: list[str] = []

    def make() -> Any:
        made.append(_Sink(name=f"sink {len(made)}", keeps_key_order=ordered_sinks))
        return made[-1]

    upkeep = SinkUpkeep(
        cast(Any, chores), scheduler, stats, RelayMetrics(),
        sink=lambda: current[0], make=make, use=lambda s: current.__setitem__(0, s), chains=chains,
        await_finishers=lambda: asked.append("await finishers"),
        settle_unreported=lambda: asked.append("settle unreported"),
    )  # fmt: skip
    return _World(upkeep, scheduler, stats, chores, chains, current, made, asked)


def test_the_first_sink_is_made_and_chained_where_it_cannot_keep_a_keys_order() -> None:
    lane = a_lane("o", "s")  # ordered by key
    w = _world([lane], ordered_sinks=False)
    w.upkeep.replace_sink()
    assert w.current[0] is w.made[0] and w.asked == [] and w.stats.sinks_replaced == 0
    assert isinstance(w.chains["o"], KeyChains)
    kept = _world([a_lane("p", "t")])
    kept.upkeep.replace_sink()
    assert kept.chains == {}  # a sink that keeps a key's order (Kafka's partitions) needs none


def test_an_unhealthy_sink_is_replaced_after_its_batches_are_settled_and_its_outage_retried_at_once() -> None:
    """Its batches are finished, not rolled back (what was delivered is archived once); what it did
    not report is due again as soon as the replacement answers, not after a backoff."""
    lane = a_lane("o", "s")
    w = _world([lane])
    w.upkeep.replace_sink()
    old = w.current[0]
    w.upkeep.replace_sink()
    assert old.closed == [0] and w.current[0] is w.made[1] is not old
    assert w.asked == ["await finishers", "settle unreported"] and w.stats.sinks_replaced == 1
    assert lane.upkept.sinks_were_down and w.upkeep.after_outage
    lane.wake.woken = False
    w.upkeep.due(0.0)  # the new sink answers: the outbox's failures for the old one are due now
    assert w.chores.ran == ["o"] and lane.wake.woken and not lane.upkept.sinks_were_down
    assert not w.upkeep.after_outage and w.upkeep.next_at() == float("inf")


def test_a_sink_down_is_probed_and_the_outage_is_retried_only_once_it_answers() -> None:
    lanes = [a_lane(f"o{i}", f"s{i}") for i in range(RETRIES_PER_STEP + 2)]
    w = _world(lanes)
    w.upkeep.replace_sink()
    sink = w.current[0]
    sink.down = "connection refused"
    w.upkeep.sinks_back()
    assert sink.probes == 1 and not w.upkeep.sinks_up and w.scheduler.sinks_seen_down > 0
    w.upkeep.due(0.0)
    assert w.chores.ran == []  # still down: nothing made due
    sink.down = None
    w.upkeep.sinks_back()
    assert sink.probes == 1 and w.upkeep.sinks_up  # answering: no probe needed
    assert w.upkeep.next_at() == 0.0
    w.upkeep.due(0.0)  # a few outboxes a step, not a thousand statements in one
    assert len(w.chores.ran) == RETRIES_PER_STEP and w.upkeep.after_outage
    w.upkeep.due(0.0)
    assert len(w.chores.ran) == len(lanes) and not w.upkeep.after_outage


def test_an_outbox_whose_retry_statement_failed_is_retried_at_a_later_step() -> None:
    lane = a_lane("o", "s")
    w = _world([lane])
    w.upkeep.replace_sink()
    w.upkeep.sinks_were_down()
    w.chores.on_session = lambda lane, what, work: None  # type: ignore[method-assign]  # the session failed
    w.upkeep.due(0.0)
    assert lane.upkept.sinks_were_down and w.upkeep.after_outage
