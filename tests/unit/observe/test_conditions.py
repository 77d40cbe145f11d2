"""outbox.conditions: an outage is one line when it starts, a summary a minute, one line when it ends."""

from __future__ import annotations

import logging

import pytest

from outbox.observe.conditions import Condition


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_is_three_kinds_of_line(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    c = Condition(logging.getLogger("test.cond"), "database", "cannot reach PostgreSQL", clock=clock)
    with caplog.at_level(logging.INFO):
        c.ok()  # nothing under way: silent
        for i in range(600):  # ten minutes, a failed attempt a second
            c.fail(f"connection refused #{i}")
            clock.now += 1.0
        c.ok()
        c.ok()
    events = [getattr(r, "event", None) for r in caplog.records]
    assert events[0] == "database.started"
    assert events[-1] == "database.ended"
    assert events.count("database.ongoing") == 9  # one a minute, not one an attempt
    assert len(caplog.records) == 11
    assert "still failing after 60 s, 61 attempts" in caplog.records[1].getMessage()
    assert "recovered after 600.0 s (600 failed attempts, last: connection refused #599)" in (
        caplog.records[-1].getMessage()
    )
    assert not c.active and c.episodes == 1


def test_a_new_episode_starts_after_recovery(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    c = Condition(logging.getLogger("test.cond"), "kafka", "cannot reach the Kafka brokers", clock=clock)
    with caplog.at_level(logging.INFO):
        c.fail("down")
        clock.now += 5
        assert c.seconds() == 5
        c.ok()
        c.fail("down again")
    assert [r.event for r in caplog.records] == ["kafka.started", "kafka.ended", "kafka.started"]  # type: ignore[attr-defined]
    assert c.episodes == 2


def test_a_problem_that_comes_and_goes_is_one_episode_until_it_settles(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found by the schedule explorer (seed 1: a sink failing one send in four): "deliveries
    failing" started and ended with every batch, eleven line pairs in a second. With ``settle``
    the episode ends only after that long without a failure."""
    clock = Clock()
    c = Condition(logging.getLogger("test.cond"), "delivery", "deliveries failing", clock=clock, settle=10.0)
    with caplog.at_level(logging.INFO):
        for _ in range(50):  # a batch every 0.1 s, every other one with a failure
            c.fail("1 events of the last batch will be retried (http_503)")
            clock.now += 0.1
            c.ok()
            clock.now += 0.1
        assert c.active and c.episodes == 1
        clock.now += 10.0
        c.ok()
    events = [getattr(r, "event", None) for r in caplog.records]
    assert events == ["delivery.started", "delivery.ended"]
    assert not c.active


def test_a_failure_its_caller_said_starts_the_episode_without_a_second_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The WAL reader logs a lost slot in an ERROR line of its own (where delivery stood): the
    episode it starts is not said again; what follows it is, as for any episode."""
    clock = Clock()
    c = Condition(logging.getLogger("test.cond"), "wal", "reading the WAL slot s failing", clock=clock)
    with caplog.at_level(logging.INFO):
        c.fail("the WAL slot s is lost", said=True)
        assert c.active and c.episodes == 1 and not caplog.records
        clock.now += 61
        c.fail("the WAL slot s is lost", said=True)  # an episode under way: its summary as usual
        c.ok()
    assert [getattr(r, "event", None) for r in caplog.records] == ["wal.ongoing", "wal.ended"]
    c.fail("refused", said=False)  # said only when it starts one: a new episode's own line
    assert [getattr(r, "event", None) for r in caplog.records][-1] == "wal.started"
