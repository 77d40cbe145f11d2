"""The schedule explorer's checker and schedules, on records made by hand: each invariant breaks
when it should, and holds when it should (benchmarks/outbox_bench/explore/checker.py)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from outbox_bench.explore.checker import check
from outbox_bench.explore.schedule import Schedule, draw
from outbox_bench.explore.search import _smaller
from outbox_bench.explore.world import Record

from outbox.cli import JsonFormatter

T0 = 1000.0


def _schedule(**kw: Any) -> Schedule:
    base = draw(4).without(ordering="key", on_dead="park", lease=5.0, delivery_timeout=2.0, max_attempts=3)
    return base.without(**kw)


def _got(
    n: int, t: float, *, what: str = "delivered", late: bool = False, attempts: int = 0
) -> dict[str, Any]:
    return {"n": n, "t": T0 + t, "sent": T0 + t - 0.01, "replied": T0 + t, "what": what, "late": late,
            "attempts": attempts, "relay": 0, "pid": 1, "id": n + 1, "key": ""}  # fmt: skip


def _record(journal: list[dict[str, Any]], **kw: Any) -> Record:
    rec = Record(kw.pop("schedule", _schedule()), t0=T0, drained=True)
    rec.committed = kw.pop("committed", {0: "k", 1: "k", 2: "k"})
    rec.archived = kw.pop("archived", sorted({r["n"] for r in journal if r["what"] == "delivered"}))
    rec.journal = sorted(journal, key=lambda r: r["t"])
    for name, value in kw.items():
        setattr(rec, name, value)
    return rec


def _invariants(rec: Record) -> list[str]:
    return [v.invariant for v in check(rec)]


def test_events_received_in_commit_order_once_each_hold() -> None:
    assert _invariants(_record([_got(0, 1.0), _got(1, 1.1), _got(2, 1.2)])) == []


def test_a_later_event_received_first_breaks_order() -> None:
    assert _invariants(_record([_got(0, 1.0), _got(2, 1.1), _got(1, 1.2)])) == ["order"]


def test_order_is_not_checked_without_key_order() -> None:
    rec = _record([_got(0, 1.0), _got(2, 1.1), _got(1, 1.2)], schedule=_schedule(ordering="none"))
    assert _invariants(rec) == []


def test_a_parked_key_moves_only_after_the_skip() -> None:
    refused = _got(1, 1.05, what="refused")
    early = _record([_got(0, 1.0), refused, _got(2, 1.1)], archived=[0, 2], dead={1: ("refused", False)},
                    actions=[("skip", T0 + 2.0, [1])])  # fmt: skip
    assert _invariants(early) == ["order"]  # 2 went while 1 was parked
    late = _record([_got(0, 1.0), refused, _got(2, 2.5)], archived=[0, 2], dead={1: ("refused", False)},
                   actions=[("skip", T0 + 2.0, [1])])  # fmt: skip
    assert _invariants(late) == []


def test_under_continue_a_refusal_lets_the_key_go_on_even_when_its_batch_was_lost() -> None:
    """Seed 9: refused, the next one sent, the batch lost, the refused one accepted later."""
    journal = [_got(0, 1.0), _got(1, 1.05, what="refused"), _got(2, 1.1), _got(1, 3.0, attempts=0)]
    assert _invariants(_record(journal, schedule=_schedule(on_dead="continue"))) == []
    assert _invariants(_record(journal, schedule=_schedule(on_dead="park"))) == ["order"]


def test_a_rolled_back_event_sent_is_a_violation() -> None:
    rec = _record([_got(0, 1.0), _got(1, 1.1), _got(2, 1.2), _got(9, 1.3)], rolled_back={9})
    assert _invariants(rec) == ["rolled back"]


def test_a_committed_event_nowhere_is_a_violation_and_one_parked_is_not() -> None:
    lost = _record([_got(0, 1.0), _got(1, 1.1)])
    assert _invariants(lost) == ["settled"]
    parked = _record([_got(0, 1.0), _got(1, 1.05, what="refused")], archived=[0],
                     dead={1: ("refused", True)}, pending=[2])  # fmt: skip
    assert _invariants(parked) == []


def test_archived_twice_is_a_violation() -> None:
    rec = _record([_got(0, 1.0), _got(1, 1.1), _got(2, 1.2)], archived=[0, 1, 2, 2])
    assert _invariants(rec) == ["archived once"]


def test_a_duplicate_needs_a_reason() -> None:
    twice = [_got(0, 1.0), _got(1, 1.1), _got(2, 1.2), _got(1, 4.0)]
    assert _invariants(_record(twice)) == ["duplicate"]
    killed = _record(twice, faults=[("kill", 0, T0 + 2.0, T0 + 3.0)])
    assert _invariants(killed) == []
    late = [_got(0, 1.0), _got(1, 1.1, late=True), _got(2, 1.2), _got(1, 4.0)]
    assert _invariants(_record(late)) == []


def test_a_lease_lost_explains_what_its_batch_sent_since_its_claim(tmp_path: Path) -> None:
    """Seed 52: a batch held out 5.7 s by a key's chained slow sends (lease 2.7 s) lost its lease;
    its first receipt came before lease + delivery timeout ahead of the loss. The loss's line says
    how long the batch was out, and that window explains it."""
    twice = [_got(0, 1.0), _got(1, 1.1), _got(2, 1.2), _got(1, 12.0)]
    log = tmp_path / "relay0-1.log"
    lost = {"ts": T0 + 11.0, "level": "warning", "msg": "ack of 3 events refused", "event": "lease.lost"}
    log.write_text(json.dumps(lost))
    assert _invariants(_record(twice, logs=[log])) == ["duplicate"]  # 9.9 s before: not that batch's
    # The line as the relay writes it (--log-format json): the field reaches the log (it did not,
    # and a loss's window was guessed from the lease alone: seed 52 again, under load).
    record = logging.LogRecord("outbox.relay", logging.WARNING, __file__, 0, lost["msg"], None, None)
    record.__dict__.update(event="lease.lost", outbox="checked", batch_age=9.95, created=lost["ts"])
    log.write_text(JsonFormatter().format(record))
    assert json.loads(log.read_text())["batch_age"] == 9.95
    assert _invariants(_record(twice, logs=[log])) == []


def test_a_line_repeated_more_than_ten_times_in_ten_seconds_breaks_the_outage_rule(tmp_path: Path) -> None:
    log = tmp_path / "relay0-1.log"
    lines = [
        {"ts": T0 + i * 0.1, "level": "warning", "msg": f"deliveries failing: {i} events"} for i in range(11)
    ]
    log.write_text("\n".join(json.dumps(x) for x in lines))
    rec = _record([_got(0, 1.0), _got(1, 1.1), _got(2, 1.2)], logs=[log])
    assert _invariants(rec) == ["logs"]
    log.write_text("\n".join(json.dumps(x) for x in lines[:10]))
    assert _invariants(rec) == []


def test_a_seed_draws_one_schedule_and_its_text_and_shrinking_makes_it_smaller() -> None:
    assert draw(7) == draw(7) and draw(7).render() == draw(7).render() and draw(7) != draw(8)
    s = draw(5)  # three relays, faults, slow keys
    smaller = list(_smaller(s))
    assert smaller
    for candidate, _ in smaller:
        sizes = (
            len(candidate.faults),
            len(candidate.freezes),
            len(candidate.actions),
            len(candidate.slow_keys),
        )
        assert (
            sum(sizes) < sum((len(s.faults), len(s.freezes), len(s.actions), len(s.slow_keys)))
            or candidate.events < s.events
            or candidate.relays < s.relays
            or candidate.twins < s.twins
        )


def test_a_twin_outbox_must_archive_every_committed_event_once_and_leave_none_pending() -> None:
    journal = [_got(0, 1.0), _got(1, 1.1), _got(2, 1.2)]
    twins = _schedule(twins=2)
    assert _invariants(_record(journal, schedule=twins, twins_archived=[[0, 1, 2], [2, 1, 0]],
                               twins_pending=[[], []])) == []  # fmt: skip
    broken = _record(journal, schedule=twins, twins_archived=[[0, 1, 1, 2], [0, 2]], twins_pending=[[], [1]])
    assert sorted(_invariants(broken)) == ["archived once", "settled", "settled"]


def test_twins_are_drawn_apart_and_shrunk_away() -> None:
    seeds = [draw(seed) for seed in range(40)]
    assert {s.twins for s in seeds} == {0, 1, 2}
    # Drawn last, on a generator of their own: a seed's other draws are what they were before twins
    # (seed 5 as it was drawn then), so every seed kept as a regression case plays the same schedule.
    five = draw(5)
    assert (five.relays, five.batch_size, five.in_flight, five.lease, five.events) == (3, 10, 3, 3.39, 100)
    with_twins = next(s for s in seeds if s.twins == 2)
    assert "1 twin outboxes" in [why for _, why in _smaller(with_twins)]
    assert "2 twin outboxes" in with_twins.render()
