"""Measuring tools of the benchmark: progress bars, CPU/RSS accounting, races, statistics."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import psutil
import psycopg

from outbox.observe.progress import Progress
from outbox.store.schema import DEFAULT_SCHEMA
from outbox_bench.contenders import ContenderSpec, run_contender
from outbox_bench.queries import query

SAMPLE_EVERY = 0.2  # seconds between samples of counters, CPU and memory
STARTUP_SECONDS = 120.0  # longest a time-boxed contender may take to move its first event


def machine(dsn: str, broker_version: str) -> dict[str, Any]:
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    with psycopg.connect(dsn) as conn:
        row = conn.execute(query("harness_server_version", DEFAULT_SCHEMA)).fetchone()
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "memory_gib": round(psutil.virtual_memory().total / 2**30, 1),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "postgresql": row[0] if row else "unknown",
        "broker": broker_version,
    }


POSTGRES_NAMES = ("postgres", "postmaster")  # what PostgreSQL's processes are called


def postgres_cpu() -> dict[int, float]:
    """CPU seconds (user + system) of every PostgreSQL process, by pid."""
    return _cpu_of(lambda name: name in POSTGRES_NAMES)


def backend_cpu(pid: int) -> float:
    """CPU seconds of the PostgreSQL server process ``pid`` (a session's ``pg_backend_pid()``);
    0.0 when no PostgreSQL process of this machine has that pid (a server elsewhere)."""
    try:
        proc = psutil.Process(pid)
        if proc.name() not in POSTGRES_NAMES:
            return 0.0
        t = proc.cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0.0
    return float(t.user + t.system)


def broker_cpu() -> dict[int, float]:
    """CPU seconds of every Tansu broker process on this machine, by pid (none when the bench
    runs against a broker elsewhere: its CPU then reads 0)."""
    return _cpu_of(lambda name: name.startswith("tansu"))


def _cpu_of(wanted: Callable[[str], bool]) -> dict[int, float]:
    out: dict[int, float] = {}
    for proc in psutil.process_iter(["name"]):
        try:
            if wanted(proc.info["name"] or ""):
                t = proc.cpu_times()
                out[proc.pid] = t.user + t.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return out


def cpu_delta(before: dict[int, float], after: dict[int, float]) -> float:
    return sum(max(0.0, t - before.get(pid, 0.0)) for pid, t in after.items())


def peak_rss_mb(pid: int) -> float:
    """Peak resident set size of ``pid`` in MiB (VmHWM)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float(psutil.Process(pid).memory_info().rss) / 2**20


@dataclass
class Race:
    """What a set of contender processes did: a time series and their resources."""

    series: list[tuple[float, int]] = field(default_factory=list)  # (seconds, events moved)
    cpu_series: list[tuple[float, float]] = field(default_factory=list)  # (seconds, contenders' CPU s)
    relay_cpu_s: float = 0.0
    postgres_cpu_s: float = 0.0
    broker_cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    moved: int = 0
    elapsed_s: float = 0.0
    # The same three from the first sample that saw an event moved to the end, and the events
    # moved meanwhile: the cost of moving events, without the start-up (imports, connections,
    # a replication slot's first read), which a short race would spread over its few events.
    relay_cpu_moving_s: float = 0.0
    postgres_cpu_moving_s: float = 0.0
    broker_cpu_moving_s: float = 0.0
    moved_measured: int = 0

    def per_1k(self, cpu_s: float) -> float:
        """``cpu_s`` (one of the ``*_moving_s``) per 1,000 events moved while it was measured."""
        return round(1000 * cpu_s / max(self.moved_measured, 1), 4)


def race(
    specs: Sequence[ContenderSpec],
    *,
    target: int | None,
    max_seconds: float,
    progress: Progress | None = None,
    on_sample: Callable[[float, int], None] | None = None,
    until: Callable[[float, int], bool] | None = None,
    boxed_from_first_move: bool = False,
    counting: bool = False,
) -> Race:
    """Run ``specs`` as processes until they moved ``target`` events, ``until(elapsed, moved)``
    said so, or ``max_seconds`` passed.

    ``counting``: the progress counts events moved even without a ``target`` (a race that ends
    on ``until``); otherwise it counts seconds.

    ``boxed_from_first_move``: ``max_seconds`` counts from the first event moved, not from the
    spawn (a time-boxed contender's start-up, slow on a loaded machine, is not its race); it
    gets at most :data:`STARTUP_SECONDS` to move its first event.
    """
    ctx = mp.get_context("spawn")
    counters = [ctx.Value("q", 0) for _ in specs]
    stop = ctx.Event()
    procs = [
        ctx.Process(target=run_contender, args=(spec, c, stop), daemon=True)
        for spec, c in zip(specs, counters, strict=True)
    ]
    for p in procs:
        p.start()
    result = Race()
    pg_before, broker_before = postgres_cpu(), broker_cpu()
    started = time.monotonic()
    cpu_last: dict[int, float] = {}
    first_move: float | None = None
    # CPU (contenders, PostgreSQL, broker) and events moved at the first sample that saw a move.
    from_move: tuple[float, dict[int, float], dict[int, float], int] | None = None
    while True:
        elapsed = time.monotonic() - started
        moved = sum(int(c.value) for c in counters)
        result.series.append((elapsed, moved))
        for p in procs:
            if p.pid is not None and p.is_alive():
                try:
                    t = psutil.Process(p.pid).cpu_times()
                    cpu_last[p.pid] = t.user + t.system
                    result.peak_rss_mb = max(result.peak_rss_mb, peak_rss_mb(p.pid))
                except psutil.NoSuchProcess:
                    pass
        result.cpu_series.append((elapsed, sum(cpu_last.values())))
        if first_move is None and moved > 0:
            first_move = elapsed
            from_move = (sum(cpu_last.values()), postgres_cpu(), broker_cpu(), moved)
        if progress is not None:
            rate = _recent_rate(result.series)
            progress.update(moved if target or counting else elapsed, f"{rate:,.0f} ev/s")
        if on_sample is not None:
            on_sample(elapsed, moved)
        if not boxed_from_first_move:
            timed_out = elapsed >= max_seconds
        elif first_move is None:
            timed_out = elapsed >= STARTUP_SECONDS
        else:
            timed_out = elapsed - first_move >= max_seconds
        done = (target is not None and moved >= target) or (until is not None and until(elapsed, moved))
        if done or timed_out:
            break
        if not all(p.is_alive() for p in procs):
            dead = [p.exitcode for p in procs if not p.is_alive()]
            stop.set()
            raise RuntimeError(f"a contender process died (exit codes {dead})")
        time.sleep(SAMPLE_EVERY)
    pg_after, broker_after = postgres_cpu(), broker_cpu()
    result.postgres_cpu_s = cpu_delta(pg_before, pg_after)
    result.broker_cpu_s = cpu_delta(broker_before, broker_after)
    result.relay_cpu_s = sum(cpu_last.values())
    if from_move is not None:
        relay_from, pg_from, broker_from, moved_from = from_move
        result.relay_cpu_moving_s = result.relay_cpu_s - relay_from
        result.postgres_cpu_moving_s = cpu_delta(pg_from, pg_after)
        result.broker_cpu_moving_s = cpu_delta(broker_from, broker_after)
        result.moved_measured = sum(int(c.value) for c in counters) - moved_from
    result.elapsed_s = time.monotonic() - started
    stop.set()
    for p in procs:
        p.join(30)
        if p.is_alive():
            p.kill()
    result.moved = sum(int(c.value) for c in counters)
    if progress is not None:
        progress.close(f"{middle_rate(result.series, result.moved):,.0f} ev/s")
    return result


def _recent_rate(series: list[tuple[float, int]], window: float = 2.0) -> float:
    if len(series) < 2:
        return 0.0
    t1, n1 = series[-1]
    for t0, n0 in reversed(series):
        if t1 - t0 >= window:
            return (n1 - n0) / (t1 - t0)
    t0, n0 = series[0]
    return (n1 - n0) / max(t1 - t0, 1e-9)


def middle_rate(series: list[tuple[float, int]], total: int, lo: float = 0.1, hi: float = 0.9) -> float:
    """Events/s between the moments ``lo`` and ``hi`` of ``total`` had been moved.

    Leaves out start-up (process spawn, connections, producer metadata) and the
    tail (the last partial batches), which say nothing about sustained speed.
    """
    if total <= 0 or len(series) < 2:
        return 0.0
    t_lo = _time_at(series, lo * total)
    t_hi = _time_at(series, hi * total)
    if t_lo is None or t_hi is None or t_hi <= t_lo:
        t0, n0 = series[0]
        t1, n1 = series[-1]
        return (n1 - n0) / max(t1 - t0, 1e-9)
    return (hi - lo) * total / (t_hi - t_lo)


def _time_at(series: list[tuple[float, int]], count: float) -> float | None:
    """Linear interpolation of when ``count`` events had been moved."""
    for (t0, n0), (t1, n1) in itertools.pairwise(series):
        if n0 <= count <= n1:
            if n1 == n0:
                return t0
            return t0 + (t1 - t0) * (count - n0) / (n1 - n0)
    return None


def percentiles(values: Sequence[float]) -> dict[str, float | None]:
    """p50/p95/p99/max of ``values`` (milliseconds in, milliseconds out)."""
    if not values:
        return {"p50": None, "p95": None, "p99": None, "max": None, "n": 0}
    ordered = sorted(values)

    def pct(p: float) -> float:
        return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]

    return {
        "p50": round(pct(50), 3),
        "p95": round(pct(95), 3),
        "p99": round(pct(99), 3),
        "max": round(ordered[-1], 3),
        "n": len(ordered),
    }


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0
