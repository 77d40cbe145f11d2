"""The bench's verdicts judge only what was measured: a p99 of a handful of events is no verdict."""

from __future__ import annotations

from typing import Any

from outbox_bench.report import FAIRNESS_SAMPLES, tenants_markdown
from outbox_bench.tenants import _phase


def _tenants(acked: int, p99: float | None) -> dict[str, Any]:
    latency = {"n": acked, "p50": None if p99 is None else p99 / 2, "p99": p99, "max": p99}
    fairness = {
        "busy_events": 6_000,
        "busy_events_per_s": 16_000.0,
        "quiet_rate": 10,
        "quiet_events": acked,
        "quiet_acked": acked,
        "quiet_latency_ms": latency,
    }
    return {"events": 100_000, "runs": [], "fairness": fairness}


def _fairness_line(t: dict[str, Any]) -> str:
    return next(line for line in tenants_markdown(t) if line.startswith("**Fairness**"))


def test_a_fairness_run_with_too_few_quiet_events_is_not_judged() -> None:
    for acked, p99 in ((0, None), (1, 2.29), (FAIRNESS_SAMPLES - 1, 500.0)):
        line = _fairness_line(_tenants(acked, p99))
        assert "not judged" in line and "--tenants-busy" in line, line
        assert "met" not in line and "missed" not in line, line


def test_a_fairness_run_with_enough_quiet_events_is_judged_against_the_target() -> None:
    assert "ms: met)" in _fairness_line(_tenants(FAIRNESS_SAMPLES, 84.0))
    assert "ms: **missed**)" in _fairness_line(_tenants(626, 135.0))


def test_a_spread_stopped_in_a_phase_shows_what_it_did_not_measure_and_why_never_a_zero() -> None:
    """Run 15: 5,000 outboxes, the vacuum of the drained tables outlasted the race's cap; the warm
    drain and the idle window were not run, and the table said 0 events/s and 0.0 % CPU."""
    one = {"outboxes": 1, "events_per_s": 20_000.0, "warm_events_per_s": 17_000.0, "ratio_to_one": 1.0,
           "warm_ratio_to_one": 1.0, "idle_transactions_per_s": 1.7, "idle_transactions_per_s_per_outbox": 1.7,
           "idle_cpu_percent": 0.8, "peak_rss_mb": 62.0, "rss_mb_per_outbox": None, "stopped": None}  # fmt: skip
    many = {**one, "outboxes": 5_000, "events_per_s": 5_486.0, "ratio_to_one": 0.27, "warm_events_per_s": None,
            "warm_ratio_to_one": None, "idle_transactions_per_s": None,
            "idle_transactions_per_s_per_outbox": None, "idle_cpu_percent": None, "peak_rss_mb": 102.0,
            "rss_mb_per_outbox": 0.008,
            "stopped": "the vacuum of the drained tables took longer than 600 s"}  # fmt: skip
    t = {**_tenants(FAIRNESS_SAMPLES, 50.0), "runs": [one, many]}
    lines = tenants_markdown(t)
    row = next(line for line in lines if line.startswith("| 5,000 |"))
    assert row == "| 5,000 | 5,486 | 0.27 | - | - | - | - | - | 102 | 0.008 |", row
    assert "| 1 | 20,000 | 1.00 | 17,000 | 1.00 | 1.7 | 1.700 | 0.8 % | 62 | - |" in lines
    assert any("stopped, the vacuum of the drained tables took longer than 600 s" in line for line in lines)


def test_a_spreads_phase_is_read_from_its_marks() -> None:
    assert _phase({}) == ("the drain", 0.0)
    assert _phase({"drained": 90.0}) == ("the vacuum of the drained tables", 90.0)
    assert _phase({"drained": 90.0, "vacuumed": 600.0}) == ("the wait for autovacuum", 600.0)
    marks = {"drained": 90.0, "vacuumed": 600.0, "from": 610.0, "to": 640.0, "committed": 700.0}
    assert _phase(marks) == ("the warm drain", 700.0)
