"""The fault suite's load windows (bench.faults.run.Window): planned seconds, then on until the
writers have committed enough, within a bound; a window short of its commits is recorded."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from outbox_bench.faults import run as fault_run
from outbox_bench.faults.config import FaultConfig


class _Clock:
    """Seconds that pass only when the test sleeps: the windows' arithmetic, not the machine's load."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@dataclass
class _Writers:
    """Commits at ``per_second`` from when it is made; ``alive`` as given."""

    clock: _Clock
    per_second: float
    alive_: bool = True
    began: float = field(init=False)

    def __post_init__(self) -> None:
        self.began = self.clock()

    @property
    def count(self) -> int:
        return int((self.clock() - self.began) * self.per_second + 1e-9)

    def alive(self) -> bool:
        return self.alive_


@dataclass
class _Run:
    writers: _Writers
    cfg: FaultConfig = field(default_factory=lambda: FaultConfig(dsn="", bootstrap="", window_commits=10))
    short_windows: list[str] = field(default_factory=list)
    marks: list[str] = field(default_factory=list)

    def mark(self, what: str) -> None:
        self.marks.append(what)


def _hold(run: Any, seconds: float) -> tuple[float, fault_run.Window]:
    clock = run.writers.clock
    w = fault_run.Window(run, "fault", seconds, clock=clock)
    began = clock()
    while w.open():
        clock.sleep(min(0.02, w.left()))
    w.close()
    return clock() - began, w


def _ended_at(took: float, seconds: float) -> bool:
    """Ended at ``seconds``, or at the first look after (the loop looks every 0.02 s)."""
    return seconds - 1e-6 <= took <= seconds + 0.02 + 1e-6


def test_a_window_with_its_commits_ends_on_time() -> None:
    run = _Run(_Writers(_Clock(), per_second=200))
    took, w = _hold(run, 0.2)
    assert _ended_at(took, 0.2) and w.committed() >= 10
    assert run.short_windows == [] and run.marks == []


def test_a_slow_writer_holds_the_window_open_until_its_commits() -> None:
    run = _Run(_Writers(_Clock(), per_second=20))  # 10 commits take 0.5 s: the window's 0.1 s is not enough
    took, w = _hold(run, 0.1)
    assert _ended_at(took, 0.5) and w.committed() >= 10
    assert run.short_windows == []
    assert len(run.marks) == 1 and run.marks[0].startswith("fault held") and "commits" in run.marks[0]


def test_a_window_ends_short_at_its_bound_and_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fault_run, "WINDOW_PATIENCE", 3.0)
    monkeypatch.setattr(fault_run, "WINDOW_GRACE", 0.0)
    run = _Run(_Writers(_Clock(), per_second=5))  # 10 commits would take 2 s; the bound is 3 × 0.1 s
    took, _ = _hold(run, 0.1)
    assert _ended_at(took, 0.3)
    assert len(run.short_windows) == 1 and run.short_windows[0].startswith("fault: ")


def test_a_window_stops_waiting_for_writers_that_died() -> None:
    run = _Run(_Writers(_Clock(), per_second=0, alive_=False))
    took, _ = _hold(run, 0.1)
    assert _ended_at(took, 0.1) and len(run.short_windows) == 1
