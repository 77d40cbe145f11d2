"""The drain's run order: every contender leads a run in turn (pure logic)."""

from outbox_bench.scenarios import rotated


def test_each_run_starts_one_contender_later() -> None:
    names = ("relay", "ceiling", "bare")
    assert [rotated(names, run) for run in range(4)] == [
        ("relay", "ceiling", "bare"),
        ("ceiling", "bare", "relay"),
        ("bare", "relay", "ceiling"),
        ("relay", "ceiling", "bare"),
    ]
