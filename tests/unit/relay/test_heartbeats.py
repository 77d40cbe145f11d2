"""outbox.relay.heartbeats.Heartbeats, built from its collaborators alone (no database): the
membership heartbeat when it is due, the sinks probed with it, and nothing between."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from outbox.relay.heartbeats import Heartbeats
from outbox.relay.lanes import Beats
from outbox.relay.metrics import RelayMetrics


@dataclass
class _Membership:
    due_at: float
    beats: list[tuple[list[int], str]] = field(default_factory=list)
    changed: bool = False
    heartbeat: Any = field(default_factory=lambda: SimpleNamespace(active=False))

    def beat(self, pids: list[int], stale: Any, label: str) -> bool:
        self.beats.append((pids, label))
        self.due_at = time.monotonic() + 5.0
        return False  # the database's relays did not change


def _heartbeats(member: _Membership) -> tuple[Heartbeats, list[str]]:
    happened: list[str] = []
    sessions = SimpleNamespace(idle_pids=lambda: [41, 42], stale=[], pid=lambda conn: None)
    beats = Heartbeats(
        cast(Any, member), cast(Any, sessions), {}, Beats(),
        RelayMetrics(), sink=lambda: None, busy=lambda: False, sinks_back=lambda: happened.append("sinks probed"),
        label=lambda: "ready", progress=lambda: happened.append("progress"), metrics_on=lambda: True,
    )  # fmt: skip
    return beats, happened


def test_the_membership_heartbeat_when_due_with_the_sinks_probed_and_not_before() -> None:
    member = _Membership(due_at=time.monotonic() + 60.0)
    beats, happened = _heartbeats(member)
    beats.due()
    assert member.beats == [] and happened == []  # not due: nothing, no statement
    member.due_at = time.monotonic()
    beats.due()
    assert member.beats == [([41, 42], "ready")]  # the idle sessions' pids, for operators
    assert happened == ["progress", "sinks probed"]  # a heartbeat that went through is progress
    beats.due()
    assert len(member.beats) == 1  # the next is a lease's fifth away
