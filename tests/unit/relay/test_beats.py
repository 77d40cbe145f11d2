"""outbox.lanes.Beats: the loop finds the due heartbeats without looking at every lane."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

from outbox.relay.lanes import Beats, Lane


@dataclass
class _Ordering:
    due_at: float


class _Lane:
    """What Beats reads of a lane: its ordering's ``due_at``; compared by identity, as Lane is."""

    def __init__(self, name: str, due_at: float) -> None:
        self.name = name
        self.ordering = _Ordering(due_at)


def _lanes(**due: float) -> dict[str, Any]:
    return {name: _Lane(name, at) for name, at in due.items()}


def _names(lanes: list[Lane]) -> list[str]:
    return [cast(Any, lane).name for lane in lanes]


def test_the_most_overdue_first_and_at_most_so_many() -> None:
    lanes = _lanes(a=5.0, b=1.0, c=3.0, d=9.0, e=2.0)
    beats = Beats()
    for lane in lanes.values():
        beats.schedule(lane)
    assert _names(beats.due(4.0, 2)) == ["b", "e"]
    assert _names(beats.due(4.0, 2)) == ["c"]  # the rest of the due ones, then nothing not due
    assert beats.due(4.0, 8) == []
    assert beats.next_at() == 5.0
    assert len(beats) == 2  # a and d; the due ones left until their heartbeat schedules them


def test_a_lane_rescheduled_or_forgotten_is_not_due_at_its_old_time() -> None:
    lanes = _lanes(a=1.0, b=1.0, c=1.0)
    beats = Beats()
    for lane in lanes.values():
        beats.schedule(lane)
    lanes["a"].ordering.due_at = 7.0  # its heartbeat moved it on
    beats.schedule(lanes["a"])
    beats.forget(lanes["b"])  # its outbox left
    assert _names(beats.due(2.0, 8)) == ["c"]
    assert _names(beats.due(7.0, 8)) == ["a"]  # once, though it had two entries
    assert beats.due(100.0, 8) == [] and len(beats) == 0


def test_a_lane_moved_later_without_being_scheduled_waits_for_its_new_time() -> None:
    lanes = _lanes(a=1.0)
    beats = Beats()
    beats.schedule(lanes["a"])
    lanes["a"].ordering.due_at = 6.0
    assert beats.due(2.0, 8) == []
    assert beats.next_at() == 6.0
    assert _names(beats.due(6.0, 8)) == ["a"]


def test_scheduling_again_at_the_same_time_adds_nothing() -> None:
    lanes = _lanes(a=1.0)
    beats = Beats()
    for _ in range(3):
        beats.schedule(lanes["a"])
    assert _names(beats.due(1.0, 8)) == ["a"]
    assert beats.next_at() is None
