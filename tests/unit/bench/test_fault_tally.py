"""The fault harness's verdict (pure logic): it must see every kind of failure it claims to."""

from __future__ import annotations

from outbox_bench.faults.tally import tally

from outbox.harness.load import Written
from outbox.harness.tap import Seen


def _w(n: int, key: str = "a", seq: int | None = None, at: float = 0.0) -> Written:
    return Written(f"e{n}", key, n if seq is None else seq, at)


def _s(w: Written, at: float = 1.0) -> Seen:
    return Seen(w.event_id, w.key, w.seq, at)


def _run(committed: list[Written], seen: list[Seen], **kw: object) -> dict[str, object]:
    args: dict[str, object] = {
        "unsure": [],
        "expected_dead": [],
        "archived": {w.event_id: 1 for w in committed},
        "dead": {},
        "pending": set(),
        "fault_end": None,
    }
    args.update(kw)
    return tally(committed=committed, seen=seen, **args)  # type: ignore[arg-type]


def test_clean_run_with_a_redelivered_range_passes() -> None:
    ws = [_w(i) for i in range(1, 6)]
    # 1 2 3 | 2 3 (replay of a range) | 4 5: duplicates, but first occurrences are in order
    seen = [_s(ws[0]), _s(ws[1]), _s(ws[2]), _s(ws[1]), _s(ws[2]), _s(ws[3]), _s(ws[4])]
    r = _run(ws, seen)
    assert r["ok"] and r["lost"] == 0 and r["duplicates"] == 2 and r["order_violations"] == 0


def test_a_missing_event_is_lost() -> None:
    ws = [_w(i) for i in range(1, 4)]
    r = _run(ws, [_s(ws[0]), _s(ws[2])])
    assert not r["ok"] and r["lost"] == 1


def test_first_occurrences_out_of_order_are_violations() -> None:
    ws = [_w(i) for i in range(1, 4)]
    r = _run(ws, [_s(ws[0]), _s(ws[2]), _s(ws[1])])
    assert not r["ok"] and r["order_violations"] == 1 and r["lost"] == 0
    assert r["order_examples"] == ["a #2 after #3"]  # shown in a failed run's row


def test_other_keys_do_not_order_each_other() -> None:
    a, b = _w(1, "a", 1), _w(2, "b", 1)
    assert _run([a, b], [_s(b), _s(a)])["ok"]


def test_archived_twice_unarchived_and_unexpected_dead_fail() -> None:
    ws = [_w(i) for i in range(1, 4)]
    seen = [_s(w) for w in ws]
    assert _run(ws, seen, archived={"e1": 2, "e2": 1, "e3": 1})["double_archived"] == 1
    assert not _run(ws, seen, archived={"e1": 1, "e2": 1})["ok"]  # e3 delivered but never archived
    r = _run(ws, seen[:2], archived={"e1": 1, "e2": 1}, dead={"e3": 1})
    assert not r["ok"] and r["unexpected_dead"] == 1 and r["lost"] == 0


def test_poison_must_die_at_once() -> None:
    good, poison = _w(1), _w(2, "p", 0)
    base = {"archived": {"e1": 1}, "expected_dead": [poison]}
    assert _run([good], [_s(good)], dead={"e2": 1}, **base)["ok"]
    assert not _run([good], [_s(good)], dead={"e2": 3}, **base)["ok"]  # retried: not "at once"
    assert not _run([good], [_s(good)], dead={}, **base)["ok"]  # never dead-lettered


def test_an_unsure_commit_counts_only_if_the_database_has_it() -> None:
    ws = [_w(1)]
    maybe = _w(2)
    # Not in the database: it did not commit, nothing is owed.
    assert _run(ws, [_s(ws[0])], unsure=[maybe])["ok"]
    # In the database (archived) but never seen: lost.
    r = _run(ws, [_s(ws[0])], unsure=[maybe], archived={"e1": 1, "e2": 1})
    assert not r["ok"] and r["lost"] == 1 and r["unsure_committed"] == 1


def test_a_message_nobody_committed_is_a_phantom() -> None:
    ws = [_w(1)]
    r = _run(ws, [_s(ws[0]), Seen("ghost", "a", 9, 1.0)])
    assert not r["ok"] and r["phantoms"] == 1


def test_time_to_recover_is_the_last_arrival_of_what_was_committed_before_the_fault_ended() -> None:
    early, late = _w(1, at=5.0), _w(2, at=20.0)
    r = _run([early, late], [Seen("e1", "a", 1, 13.0), Seen("e2", "a", 2, 21.0)], fault_end=10.0)
    assert r["recover_seconds"] == 3.0
    r = _run([early, late], [Seen("e2", "a", 2, 21.0)], fault_end=10.0)
    assert r["recover_seconds"] is None  # never recovered


def test_order_is_judged_in_log_order_not_arrival_order() -> None:
    a1, a2, a3 = _w(1), _w(2), _w(3)
    # The live read skipped offset 1; a re-read found it later: it arrives last, but
    # sits between 0 and 2 in the log, where the relay put it.
    late = [
        Seen("e1", "a", 1, 1.0, (0, 0, 0)),
        Seen("e3", "a", 3, 1.1, (0, 0, 2)),
        Seen("e2", "a", 2, 9.0, (0, 0, 1)),
    ]
    assert _run([a1, a2, a3], late)["order_violations"] == 0
    # Really out of order in the log: a violation, whenever it was read.
    wrong = [
        Seen("e1", "a", 1, 1.0, (0, 0, 0)),
        Seen("e3", "a", 3, 1.1, (0, 0, 1)),
        Seen("e2", "a", 2, 1.2, (0, 0, 2)),
    ]
    assert _run([a1, a2, a3], wrong)["order_violations"] == 1
    # A broker that came back empty starts a new log: its records follow the old life's.
    lives = [
        Seen("e2", "a", 2, 1.0, (1, 0, 0)),
        Seen("e1", "a", 1, 2.0, (0, 0, 7)),
        Seen("e3", "a", 3, 3.0, (1, 0, 1)),
    ]
    assert _run([a1, a2, a3], lives)["order_violations"] == 0
