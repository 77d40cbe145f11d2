"""The limits scenario: limits per destination and weights per outbox, measured on real sinks.

Each relay is ``outbox relay`` in a process of its own, its defaults but the options named.

- **Beside a limited route.** One outbox: ``limits_fast`` realistic events to Kafka, and in one
  run of each pair also ``limits_slow`` events (written first: lower ids) to a webhook receiver
  limited to ``limits_rate``/s. The Kafka route's drain (events/s over the middle 80 %, read from
  the archive) with the limited backlog waiting against without it, pairs interleaved: the
  median ratio (target >= 0.9: a limited route's backlog waits in the table, it does not slow
  the others).
- **Rate across relays.** Two relay processes on one outbox, a webhook limited to
  ``limits_rate``/s: requests a second at the receiver over the middle of the drain, against the
  limit (target: within 10 %).
- **Weights.** Two outboxes with a backlog each, one relay with ``--weight 'gold*=3'`` and two
  sessions (``--max-connections 2``: they contend): the events archived of each while both have
  a backlog (target: 3:1 within 20 %).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import psycopg

from outbox import enqueue_many
from outbox.harness.infra import create_topic
from outbox.observe.progress import Progress
from outbox.store.dsn import for_child
from outbox.store.migrate import migrate
from outbox_bench.config import BenchConfig
from outbox_bench.events import FILL_CHUNK, realistic
from outbox_bench.harness.sinktaps import Clocked
from outbox_bench.measure import middle_rate
from outbox_bench.queries import query

SECRET = "whsec_" + "YmVuY2gtbGltaXRzLWJlbmNoLWxpbWl0cy1iZW5jaCE="
SAMPLE = 0.1  # seconds between readings of the archive


def _schema(cfg: BenchConfig, tag: str) -> str:
    name = f"bench_lim_{tag}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(cfg.dsn, autocommit=True) as conn:
        migrate(conn, name)
    return name


def _drop(cfg: BenchConfig, schema: str) -> None:
    with psycopg.connect(cfg.dsn, autocommit=True) as conn:
        conn.execute(query("harness_drop_schema", schema))


def _fill(cfg: BenchConfig, schema: str, topic: str, n: int, keys: str) -> None:
    with psycopg.connect(cfg.dsn) as conn:
        for start in range(0, n, FILL_CHUNK):
            events = [realistic(i, topic) for i in range(start, min(n, start + FILL_CHUNK))]
            for e in events:
                e["key"] = f"{keys}-{e.get('key', '')}"
            enqueue_many(conn, events, schema=schema)
            conn.commit()


def _relay(cfg: BenchConfig, schema: str, *args: str) -> subprocess.Popen[bytes]:
    dsn, secret = for_child(cfg.dsn)
    env_args = ["--dsn", dsn, "--schema", schema, *args, "--log-level", "warning"]
    return subprocess.Popen(
        [sys.executable, "-m", "outbox", "relay", *env_args],
        env={**_env(), **secret, "OUTBOX_WEBHOOK_SECRET": SECRET},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}


def _archived(cfg: BenchConfig, schema: str, topic: str) -> int:
    with psycopg.connect(cfg.dsn, autocommit=True) as conn:
        row = conn.execute(query("bench_archived_of_topic", schema), {"topic": topic}).fetchone()
    return int(row[0]) if row else 0


def _watch(until: Callable[[], bool], read: Callable[[], int], limit: float) -> list[tuple[float, int]]:
    series: list[tuple[float, int]] = []
    start = time.monotonic()
    while time.monotonic() - start < limit:
        series.append((time.monotonic() - start, read()))
        if until():
            break
        time.sleep(SAMPLE)
    return series


def beside(cfg: BenchConfig, limited: bool, clock: Clocked) -> float:
    """The Kafka route's drain, with or without the limited route's backlog waiting."""
    schema = _schema(cfg, "beside")
    fast = f"bench.limits.fast.{uuid.uuid4().hex[:6]}"
    create_topic(cfg.bootstrap, fast, 4)
    try:
        if limited:
            _fill(cfg, schema, "partner.calls", cfg.limits_slow, "slow")
        _fill(cfg, schema, fast, cfg.limits_fast, "fast")
        proc = _relay(
            cfg, schema, "--route", f"partner.*={clock.url}", "--route", f"*=kafka://{cfg.bootstrap}",
            "--limit", f"partner.*={cfg.limits_rate}/s",
        )  # fmt: skip
        try:
            series = _watch(
                lambda: _archived(cfg, schema, fast) >= cfg.limits_fast,
                lambda: _archived(cfg, schema, fast),
                cfg.max_race_seconds,
            )
        finally:
            proc.terminate()
            proc.wait(60)
        return middle_rate(series, cfg.limits_fast)
    finally:
        _drop(cfg, schema)


def across(cfg: BenchConfig) -> dict[str, Any]:
    """Two relays, one limited webhook: requests a second at the receiver."""
    clock = Clocked()
    schema = _schema(cfg, "across")
    n = max(100, int(cfg.limits_rate * cfg.limits_seconds))
    try:
        _fill(cfg, schema, "partner.calls", n, "slow")
        args = ("--route", f"partner.*={clock.url}", "--limit", f"partner.*={cfg.limits_rate}/s")
        procs = [_relay(cfg, schema, *args) for _ in range(2)]
        try:
            _watch(lambda: len(clock.times) >= n, lambda: len(clock.times), cfg.max_race_seconds)
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(60)
        times = sorted(clock.times)
        rate = clock.rate(int(len(times) * 0.1), int(len(times) * 0.9))
        t0 = times[0] if times else 0.0
        per_second: dict[int, int] = {}
        for t in times:
            per_second[int(t - t0)] = per_second.get(int(t - t0), 0) + 1
        return {
            "events": n,
            "limit": cfg.limits_rate,
            "requests_per_s": round(rate, 2),
            "ratio": round(rate / cfg.limits_rate, 3),
            "per_second": [per_second.get(s, 0) for s in range(max(per_second, default=-1) + 1)],
        }
    finally:
        clock.receiver.close()
        _drop(cfg, schema)


def weights(cfg: BenchConfig) -> dict[str, Any]:
    """Two outboxes, --weight 'gold*=3', two sessions: each one's archived events while both have
    a backlog."""
    gold, basic = _schema(cfg, "gold"), _schema(cfg, "basic")
    topic = f"bench.limits.weights.{uuid.uuid4().hex[:6]}"
    create_topic(cfg.bootstrap, topic, 4)
    n = cfg.limits_weight_events
    try:
        for s in (gold, basic):
            _fill(cfg, s, topic, n, s)
        spec = f"gold={cfg.dsn}#{gold}\nbasic={cfg.dsn}#{basic}"
        args = ["--kafka-bootstrap", cfg.bootstrap, "--weight", "gold*=3", "--max-connections", "2"]
        proc = subprocess.Popen(
            [sys.executable, "-m", "outbox", "relay", *args, "--log-level", "warning"],
            env={**_env(), "OUTBOX_OUTBOXES": spec}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            series = _watch(
                lambda: _archived(cfg, basic, topic) >= n or _archived(cfg, gold, topic) >= n,
                lambda: _archived(cfg, gold, topic) * 1_000_000 + _archived(cfg, basic, topic),
                cfg.max_race_seconds,
            )
        finally:
            proc.terminate()
            proc.wait(60)
        both = [(t, v // 1_000_000, v % 1_000_000) for t, v in series]
        # From a tenth of the gold backlog to the last reading while both had one.
        window = [(t, g, b) for t, g, b in both if g >= n * 0.1 and g < n and b < n]
        if len(window) < 2:
            return {"events": n, "gold": None, "basic": None, "ratio": None}
        (_, g0, b0), (_, g1, b1) = window[0], window[-1]
        return {
            "events": n,
            "gold": g1 - g0,
            "basic": b1 - b0,
            "ratio": round((g1 - g0) / max(1, b1 - b0), 3),
            "series": [(round(t, 2), g, b) for t, g, b in both],
        }
    finally:
        _drop(cfg, gold)
        _drop(cfg, basic)


def limits(cfg: BenchConfig) -> dict[str, Any]:
    clock = Clocked()
    pairs: list[tuple[float, float]] = []
    progress = Progress("limits: beside a limited route", cfg.limits_pairs * 2, " runs")
    try:
        for k in range(cfg.limits_pairs):
            order = (False, True) if k % 2 == 0 else (True, False)
            got = {limited: beside(cfg, limited, clock) for limited in order}
            pairs.append((got[False], got[True]))
            progress.update(2 * (k + 1))
    finally:
        progress.close()
        clock.receiver.close()
    ratios = [w / wo for wo, w in pairs if wo > 0]
    return {
        "fast_events": cfg.limits_fast,
        "slow_events": cfg.limits_slow,
        "rate": cfg.limits_rate,
        "beside": {
            "pairs": [{"without": round(wo, 1), "with": round(w, 1)} for wo, w in pairs],
            "ratio_median": round(statistics.median(ratios), 3) if ratios else None,
        },
        "across": across(cfg),
        "weights": weights(cfg),
    }
