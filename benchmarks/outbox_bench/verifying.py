"""The verify scenario: how fast ``outbox verify`` reads a backlog's deliveries back from Kafka,
what that costs the broker and PostgreSQL, and what it costs a drain running beside it."""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import Any

import psycopg

from outbox.observe.progress import Progress
from outbox.sinks.routes import parse_routes
from outbox.verify import readers, run
from outbox_bench.config import BenchConfig
from outbox_bench.measure import backend_cpu, broker_cpu, cpu_delta, median, middle_rate, race
from outbox_bench.workspace import Workspace

BESIDE_RATE = 20_000.0  # the read-back beside a drain: outbox verify's default --rate
SAMPLED = (1000.0, 100)  # and the relay's own verification's defaults: --verify-rate, --verify-sample


def verify(cfg: BenchConfig) -> dict[str, Any]:
    """``cfg.verify_events`` delivered by the relay, then read back ``cfg.repeat`` times alone;
    then drains of ``cfg.verify_drain_events`` alone and beside a read-back, interleaved."""
    n, m = cfg.verify_events, cfg.verify_drain_events
    routes = parse_routes([], cfg.bootstrap)
    with Workspace(cfg.dsn, cfg.bootstrap, "verify") as ws:
        ws.fill(n, "verify", shape="realistic")
        race([ws.spec("relay")], target=n, max_seconds=cfg.max_race_seconds,
             progress=Progress("verify: deliver", n, " ev"))  # fmt: skip
        _archived(cfg, ws, n)
        alone = [_read_back(cfg, ws, routes, f"verify: read back #{i + 1}") for i in range(cfg.repeat)]
        assert all(r["present"] == r["events"] == n for r in alone), [
            (r["present"], r["events"]) for r in alone
        ]
        pairs = []
        for i in range(cfg.repeat):
            alone_run = _drain(cfg, ws, m, routes, None, label=f"verify: drain alone #{i + 1}")
            beside_run = _drain(cfg, ws, m, routes, (BESIDE_RATE, 1), label=f"verify: drain beside #{i + 1}")
            sampled_run = _drain(cfg, ws, m, routes, SAMPLED, label=f"verify: drain sampled #{i + 1}")
            pairs.append({"without": alone_run, "with": beside_run, "sampled": sampled_run})
    rates = [r["events_per_s"] for r in alone]
    mid = sorted(alone, key=lambda r: r["events_per_s"])[len(alone) // 2]
    without = median([p["without"]["events_per_s"] for p in pairs])
    with_ = median([p["with"]["events_per_s"] for p in pairs])
    sampled = median([p["sampled"]["events_per_s"] for p in pairs])
    return {
        "events": n,
        "read_back": {
            "events_per_s_median": round(median(rates), 1),
            "events_per_s_runs": rates,
            "seconds_per_million": round(1e6 / max(median(rates), 1e-9), 1),
            "verify_cpu_s_per_1k": mid["verify_cpu_s_per_1k"],
            "broker_cpu_s_per_1k": mid["broker_cpu_s_per_1k"],
            "postgres_cpu_s_per_1k": mid["postgres_cpu_s_per_1k"],
        },
        "beside": {
            "drain_events": m,
            "verify_rate": BESIDE_RATE,
            "pairs": pairs,
            "without_events_per_s_median": round(without, 1),
            "with_events_per_s_median": round(with_, 1),
            "ratio_with_to_without": round(with_ / max(without, 1e-9), 3),
            "sampled": {"rate": SAMPLED[0], "sample": SAMPLED[1]},
            "sampled_events_per_s_median": round(sampled, 1),
            "ratio_sampled_to_without": round(sampled / max(without, 1e-9), 3),
        },
    }


def _archived(cfg: BenchConfig, ws: Workspace, n: int, timeout: float = 60.0) -> None:
    """Until the archive holds ``n`` deliveries: the race ends on what the relay sent, and its
    last batches are archived a moment later (a first read-back once checked 999,500 of a million)."""
    deadline = time.monotonic() + timeout
    since, _ = _window()
    with psycopg.connect(cfg.dsn, autocommit=True) as conn:
        while run.count(conn, ws.schema, since, dt.datetime.now(dt.timezone.utc), None) < n:
            if time.monotonic() > deadline:
                raise AssertionError(f"the archive did not reach {n} deliveries in {timeout:g} s")
            time.sleep(0.2)


def _window() -> tuple[dt.datetime, dt.datetime]:
    now = dt.datetime.now(dt.timezone.utc)
    return now - dt.timedelta(days=1), now


def _read_back(cfg: BenchConfig, ws: Workspace, routes: Any, label: str) -> dict[str, Any]:
    """One unbounded read-back of everything the workspace delivered, timed and costed."""
    since, until = _window()
    with psycopg.connect(cfg.dsn) as conn:
        pid = conn.info.backend_pid
        total = run.count(conn, ws.schema, since, until, None)
        progress = Progress(label, total, " ev")
        cpu0, broker0, pg0, t0 = time.process_time(), broker_cpu(), backend_cpu(pid), time.monotonic()
        report = run.verify(conn, ws.schema, routes, readers.reader_for, since=since, until=until,
                            progress=progress.update)  # fmt: skip
        elapsed = time.monotonic() - t0
        cpu, broker, pg = time.process_time() - cpu0, cpu_delta(broker0, broker_cpu()), backend_cpu(pid) - pg0
        progress.close()
    k = max(report.checked, 1) / 1000
    return {
        "events": report.checked,
        "present": report.counts["present"],
        "seconds": round(elapsed, 2),
        "events_per_s": round(report.checked / max(elapsed, 1e-9), 1),
        "verify_cpu_s_per_1k": round(cpu / k, 4),
        "broker_cpu_s_per_1k": round(broker / k, 4),
        "postgres_cpu_s_per_1k": round(pg / k, 4),
    }


def _drain(
    cfg: BenchConfig, ws: Workspace, m: int, routes: Any, beside: tuple[float, int] | None, *, label: str
) -> dict[str, Any]:
    """``m`` events written to an outbox of their own and drained by the relay; ``beside`` (a
    rate and a sample): while a read-back of ``ws``'s archive runs, again and again, on this
    process's thread. A fresh outbox each drain, as the drain scenario has: refilled right after
    the million's drain, the relay's acks ran past their statement timeout (not looked into)."""
    stop = threading.Event()
    read: list[int] = []

    def verifying() -> None:
        since, until = _window()
        with psycopg.connect(cfg.dsn) as conn:
            while not stop.is_set():
                assert beside is not None
                report = run.verify(conn, ws.schema, routes, readers.reader_for, since=since, until=until,
                                    rate=beside[0], sample=beside[1], stopping=stop.is_set)  # fmt: skip
                read.append(report.checked)

    thread = threading.Thread(target=verifying, name="bench-verify", daemon=True)
    with Workspace(cfg.dsn, cfg.bootstrap, "verify_drain") as drained:
        drained.fill(m, label, shape="realistic")
        if beside is not None:
            thread.start()
        try:
            result = race([drained.spec("relay")], target=m, max_seconds=cfg.max_race_seconds,
                          progress=Progress(label, m, " ev"))  # fmt: skip
        finally:
            stop.set()
            if beside is not None:
                thread.join(60)
    return {
        "events": result.moved,
        "events_per_s": round(middle_rate(result.series, m), 1),
        "read_back_meanwhile": sum(read),
    }


def markdown(v: dict[str, Any]) -> list[str]:
    r, b = v["read_back"], v["beside"]
    return [
        f"**Verify**: `outbox verify` reads {v['events']:,} delivered events back from Kafka (partition "
        "and offset ranges, every event compared), alone; then the relay drains "
        f"{b['drain_events']:,} events alone and beside a read-back at {b['verify_rate']:,.0f} events/s "
        "(interleaved pairs).",
        "",
        "| read back | events/s | a million in | verify CPU s / 1k | broker CPU s / 1k "
        "| PostgreSQL CPU s / 1k |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
        f"| alone | {r['events_per_s_median']:,.0f} | {r['seconds_per_million']:,.0f} s | "
        f"{r['verify_cpu_s_per_1k']} | {r['broker_cpu_s_per_1k']} | {r['postgres_cpu_s_per_1k']} |",
        "",
        "| the relay's drain | events/s (median) |",
        "| --- | ---: |",
        f"| alone | {b['without_events_per_s_median']:,.0f} |",
        f"| beside the read-back | {b['with_events_per_s_median']:,.0f} "
        f"({b['ratio_with_to_without']} of alone) |",
        f"| beside the relay's own verification (1 in {b['sampled']['sample']}, at most "
        f"{b['sampled']['rate']:,.0f}/s) | {b['sampled_events_per_s_median']:,.0f} "
        f"({b['ratio_sampled_to_without']} of alone) |",
        "",
    ]


def plot(v: dict[str, Any], ax: Any) -> None:
    b = v["beside"]
    alone = [p["without"]["events_per_s"] for p in b["pairs"]]
    beside = [p["with"]["events_per_s"] for p in b["pairs"]]
    sampled = [p["sampled"]["events_per_s"] for p in b["pairs"]]
    xs = range(len(alone))
    ax.bar([x - 0.27 for x in xs], alone, 0.27, label="drain alone")
    ax.bar(list(xs), beside, 0.27, label=f"beside verify ({b['verify_rate']:,.0f}/s)")
    ax.bar([x + 0.27 for x in xs], sampled, 0.27, label="beside the relay's sampled verify")
    ax.set_xlabel("pair")
    ax.set_ylabel("events/s")
    ax.set_title(f"read back alone: {v['read_back']['events_per_s_median']:,.0f} events/s")
    ax.legend()
