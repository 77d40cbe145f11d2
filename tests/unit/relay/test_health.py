"""outbox.relay.health.RelayHealth, built from its collaborators alone (no database): readiness
as the relay's state changes, and a stall said from the clock."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, cast

from outbox.relay.config import RelayConfig
from outbox.relay.health import RelayHealth

_QUIET = SimpleNamespace(active=False)  # a condition that has said nothing


class _Sink:
    def __init__(self, healthy: bool) -> None:
        self._healthy = healthy

    def healthy(self) -> bool:
        return self._healthy


def test_readiness_follows_the_relays_state() -> None:
    running, stopped = threading.Event(), threading.Event()
    state: dict[str, Any] = {"sink": _Sink(True), "stopping": False}
    health = RelayHealth(
        RelayConfig("postgresql://unused", stall_timeout=30.0),
        cast(Any, SimpleNamespace(database=_QUIET)), cast(Any, SimpleNamespace(heartbeat=_QUIET)), {},
        running, stopped, sink=lambda: state["sink"], stopping=lambda: state["stopping"],
    )  # fmt: skip
    assert health.readiness().label == "starting"
    running.set()
    assert health.readiness().label == "ready"
    state["sink"] = _Sink(False)
    assert health.readiness().label == "sink unhealthy"
    state["sink"] = _Sink(True)
    health.loop_progress = time.monotonic() - 120  # no claim or heartbeat for two minutes
    assert health.readiness().label == "stalled"
    health.loop_progress = time.monotonic()
    state["stopping"] = True
    assert health.readiness().label == "draining"


def test_a_claim_that_went_through_is_progress_as_a_heartbeat_is() -> None:
    """The claims stamp the recorder (BatchRecorder.last_claim), not the health: a relay whose
    heartbeats are far apart but whose claims go through is not stalled."""
    running, stopped = threading.Event(), threading.Event()
    claimed = {"at": time.monotonic() - 120}
    health = RelayHealth(
        RelayConfig("postgresql://unused", stall_timeout=30.0),
        cast(Any, SimpleNamespace(database=_QUIET)), cast(Any, SimpleNamespace(heartbeat=_QUIET)), {},
        running, stopped, sink=lambda: _Sink(True), stopping=lambda: False, last_claim=lambda: claimed["at"],
    )  # fmt: skip
    running.set()
    health.loop_progress = time.monotonic() - 120
    assert health.readiness().label == "stalled"
    claimed["at"] = time.monotonic()
    assert health.readiness().label == "ready"
