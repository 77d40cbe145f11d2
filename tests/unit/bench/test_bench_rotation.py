"""The drain's and the steady scenario's run order: every contender leads a run in turn (pure
logic)."""

from outbox_bench.scenarios import rotated, steady_order


def test_each_run_starts_one_contender_later() -> None:
    names = ("relay", "ceiling", "bare")
    assert [rotated(names, run) for run in range(4)] == [
        ("relay", "ceiling", "bare"),
        ("ceiling", "bare", "relay"),
        ("bare", "relay", "ceiling"),
        ("relay", "ceiling", "bare"),
    ]


def test_the_steady_runs_in_wal_capture_take_their_turn_with_the_others() -> None:
    """Not after every other run, minutes later: a machine that drifts hits each alike."""
    table, loop, wal = ("relay", "table"), ("steady_loop", "table"), ("relay", "wal")
    assert [steady_order(i, wal=True) for i in range(3)] == [
        [table, loop, wal], [loop, wal, table], [wal, table, loop]
    ]  # fmt: skip
    assert [steady_order(i, wal=False) for i in range(2)] == [[table, loop], [loop, table]]
