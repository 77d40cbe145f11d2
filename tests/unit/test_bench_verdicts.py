"""The bench's verdicts judge only what was measured: a p99 of a handful of events is no verdict."""

from __future__ import annotations

from typing import Any

from outbox.bench.report import FAIRNESS_SAMPLES, tenants_markdown


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
