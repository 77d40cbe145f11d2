"""The snapshot scenario: steady writes while another session holds a snapshot, table capture
against WAL capture (issue 30).

A long transaction elsewhere (a report, a backup, an analyst's open session) holds a snapshot:
vacuum cannot remove what was deleted since it began. In table capture every delivered event is
a dead row until then, so the events table grows and the claims walk ever more dead entries. In
WAL capture the events never touch a table.

For each capture mode, in a fresh outbox: writer processes commit ``snapshot_rate`` business
transactions per second (an order and its event) for ``snapshot_minutes``, while a session holds
a REPEATABLE READ snapshot open from before the first write to after the last. One relay, as
``outbox relay`` runs it, delivers to Kafka. Reported per window (a minute, or a fifth of a short
run): events delivered per second, commit -> broker ack p50 / p99 (of every event in a run of
up to 100,000; beyond, of a sixteenth of them, chosen by their id), and, sampled throughout, the
events table's size and the WAL the slot keeps and has not confirmed. Flat: every window's p99
within 10 % of the first window's, and every window delivering what was written.

The control (``snapshot_control``, on by default): each mode again for the same minutes with no
snapshot held. On two cores, with no snapshot at all, one minute's p99 differed from the first's
by up to 1.55x (WAL capture, 2,000/s; 1.47x table capture;
benchmarks/runs/2026-11-25-wal/snapshot-2000-control): the 10 % criterion alone cannot tell the
snapshot's cost from the machine's. The held run's worst minute against the control's worst
minute can.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg

from outbox import capture
from outbox.observe.progress import Progress
from outbox_bench.config import BenchConfig
from outbox_bench.contenders import ack_sampled
from outbox_bench.measure import percentiles, race
from outbox_bench.queries import query
from outbox_bench.workspace import STEADY_GRACE_SECONDS, SnapshotHolder, Workspace, Writers, wal_capable

WINDOW = 60.0  # seconds per reported window (shorter runs: a fifth of the run)
FLAT_P99 = 1.10  # every window's p99 within 10 % of the first window's
SAMPLES = 300  # samples of the table and the slot per run, at most (and at least one per 2 s)
# Runs that write more events keep the ack times of a sixteenth of them (memory: ten minutes at
# 2,000/s is 1.2 million). Shorter runs keep every one: a sixteenth of a short run's window beside
# a loaded suite (a writer at 3 events/s: 4 a window) was often none at all.
EVERY_ACK_UP_TO = 100_000


def _keeps(cfg: BenchConfig) -> Callable[[str], bool]:
    """Which events' ack times a run keeps."""
    every = cfg.snapshot_rate * cfg.snapshot_minutes * 60 <= EVERY_ACK_UP_TO
    return (lambda _event_id: True) if every else ack_sampled


def snapshot(cfg: BenchConfig) -> dict[str, Any]:
    """Table capture, then WAL capture (when the server can), each under a held snapshot."""
    modes = ["table"] + (["wal"] if wal_capable(cfg.dsn) else [])
    runs = []
    for mode in modes:
        held = snapshot_once(cfg, mode)
        runs.append(held)
        if cfg.snapshot_control:
            control = snapshot_once(cfg, mode, held=False)
            runs.append(control)
            held["worst_to_control_worst"] = _worst_ratio(held, control)
    out: dict[str, Any] = {"minutes": cfg.snapshot_minutes, "rate": cfg.snapshot_rate, "runs": runs}
    if len(modes) < 2:
        out["skipped"] = "WAL capture needs wal_level = logical and PostgreSQL 14+"
    return out


def _worst_ratio(held: dict[str, Any], control: dict[str, Any]) -> float | None:
    """The held run's worst window p99 over the control's worst (None: a run without any)."""
    worst = [max((w["ack_p99_ms"] for w in r["windows"] if w["ack_p99_ms"] is not None), default=None)
             for r in (held, control)]  # fmt: skip
    return round(worst[0] / worst[1], 3) if worst[0] is not None and worst[1] else None


def snapshot_once(cfg: BenchConfig, mode: str, *, held: bool = True) -> dict[str, Any]:
    """One capture mode's run: under a held snapshot, or (``held`` False) the control without."""
    seconds = cfg.snapshot_minutes * 60
    window = min(WINDOW, seconds / 5)
    name = f"snap_{mode}" if held else f"snap_{mode}_ctl"
    with Workspace(cfg.dsn, cfg.bootstrap, name) as ws, tempfile.TemporaryDirectory() as tmp:
        if mode == "wal":
            ws.capture_wal()
        slot = None
        with psycopg.connect(cfg.dsn, autocommit=True) as conn:
            slot = capture.state(conn, ws.schema).slot
        ack_log = str(Path(tmp) / "acks.json")
        spec = ws.spec("relay")
        spec.ack_log = ack_log
        spec.ack_sample = _keeps(cfg) is ack_sampled
        writers = Writers(ws, cfg.snapshot_rate, seconds, record=True)
        # Held from before the first write to the end (the control: none).
        holder = SnapshotHolder(cfg.dsn, ws.schema) if held else None
        monitor = psycopg.connect(cfg.dsn, autocommit=True)
        health = query("hot_table_stats", ws.schema)
        retained = query("bench_slot_wal", ws.schema)
        samples: list[dict[str, Any]] = []
        every = max(2.0, seconds / SAMPLES)
        last = [-every]
        started: list[float] = []

        wall: list[float] = []  # the wall-clock time at the race's zero (commits are wall times)

        def on_sample(elapsed: float, moved: int) -> None:
            if not wall:
                wall.append(time.time() - elapsed)
            if not started and elapsed >= 1.5:  # the relay connected: hold, then write
                if holder is not None:
                    holder.start()
                started.append(elapsed)
                writers.start()
            if elapsed - last[0] < every:
                return
            last[0] = elapsed
            row = monitor.execute(health, {"schema": ws.schema}).fetchone()
            _, _, size = row if row else (0, 0, 0)
            kept = unconfirmed = 0
            if slot is not None:
                got = monitor.execute(retained, {"slot": slot}).fetchone()
                kept, unconfirmed = (int(got[0] or 0), int(got[1] or 0)) if got else (0, 0)
            samples.append(
                {
                    "t": elapsed,  # on the windows' clock below
                    "table_bytes": int(size),
                    "slot_retained_bytes": kept,
                    "slot_unconfirmed_bytes": unconfirmed,
                    "written": writers.written,
                    "delivered": moved,
                }
            )

        def caught_up(_elapsed: float, moved: int) -> bool:
            return bool(started) and not writers.alive() and moved >= writers.written

        label = f"snapshot {mode} capture, {cfg.snapshot_rate:,}/s" + ("" if held else ", none held")
        result = race(
            [spec],
            target=None,
            max_seconds=seconds + STEADY_GRACE_SECONDS,
            progress=Progress(label, seconds + 3, "s"),
            on_sample=on_sample,
            until=caught_up,
        )
        if holder is not None:
            holder.release()
        monitor.close()
        commits = writers.join()
        acks: dict[str, float] = dict(json.loads(Path(ack_log).read_text())) if Path(ack_log).exists() else {}
    # The series on the windows' clock: seconds since the first commit.
    first = min(commits.values(), default=0.0) - (wall[0] if wall else 0.0)
    series = [(t - first, n) for t, n in result.series if t >= first]
    for sample in samples:
        sample["t"] = round(sample["t"] - first, 2)
    return {**_summary(mode, cfg, commits, acks, samples, window, series), "held": held}


def _summary(
    mode: str,
    cfg: BenchConfig,
    commits: dict[str, float],
    acks: dict[str, float],
    samples: list[dict[str, Any]],
    window: float,
    series: list[tuple[float, int]],
) -> dict[str, Any]:
    t0 = min(commits.values(), default=0.0)
    buckets: dict[int, list[float]] = {}
    written: dict[int, int] = {}
    for event_id, at in commits.items():
        w = int((at - t0) // window)
        written[w] = written.get(w, 0) + 1
        if event_id in acks:
            buckets.setdefault(w, []).append((acks[event_id] - at) * 1000)
    last = int(cfg.snapshot_minutes * 60 / window + 1e-9)  # whole windows of the writers' time
    windows = []
    for w in range(last):
        p = percentiles(buckets.get(w, []))
        windows.append(
            {
                "from_s": round(w * window, 1),
                "written": written.get(w, 0),
                "written_per_s": round(written.get(w, 0) / window, 1),
                "delivered_per_s": round(_moved_at(series, (w + 1) * window) - _moved_at(series, w * window))
                / window,
                "acked_sampled": len(buckets.get(w, [])),
                "ack_p50_ms": p["p50"],
                "ack_p99_ms": p["p99"],
            }
        )
    p99s = [x["ack_p99_ms"] for x in windows if x["ack_p99_ms"] is not None]
    worst = max(p99s[1:], default=p99s[0] if p99s else None)
    ratio = round(worst / p99s[0], 3) if p99s and worst is not None and p99s[0] else None
    sampled = sum(1 for e in commits if e in acks)
    keep = _keeps(cfg)
    expected = sum(1 for e in commits if keep(e))
    table = [s["table_bytes"] for s in samples]
    return {
        "capture": mode,
        "written": len(commits),
        "delivered": series[-1][1] if series else 0,
        "window_s": window,
        "acks_kept": "all" if keep is not ack_sampled else "a sixteenth",
        "windows": windows,
        "p99_worst_to_first": ratio,
        "flat": ratio is not None and ratio <= FLAT_P99,
        "all_acked": sampled >= expected,
        "table_bytes_first": table[0] if table else 0,
        "table_bytes_peak": max(table, default=0),
        "table_bytes_last": table[-1] if table else 0,
        "slot_retained_peak_bytes": max((s["slot_retained_bytes"] for s in samples), default=0),
        "slot_unconfirmed_peak_bytes": max((s["slot_unconfirmed_bytes"] for s in samples), default=0),
        "samples": samples,
        "series": [(round(t, 2), n) for t, n in series[:: max(1, len(series) // 2000)]],
    }


def _moved_at(series: list[tuple[float, int]], t: float) -> int:
    """Events the relay had moved ``t`` seconds after the writers started (the last sample then)."""
    moved = 0
    for at, n in series:
        if at > t:
            break
        moved = n
    return moved
