"""The benchmark's scenarios: drain, steady, writer, soak, scale (sinks and console: modules of their own).

Every scenario works in fresh schemas it creates and drops, on the PostgreSQL
and broker it is given. Speed figures are medians over repeats, reported next
to the baselines measured in the same run.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import psycopg

from outbox.harness.tap import Tap
from outbox.observe.progress import Progress
from outbox_bench import peers
from outbox_bench.config import BenchConfig
from outbox_bench.console import console as console  # the console scenario, run by name too
from outbox_bench.contenders import ContenderSpec
from outbox_bench.limits import limits as limits  # the limits scenario: --limit and --weight
from outbox_bench.measure import Race, median, middle_rate, percentiles, race
from outbox_bench.needs import install, missing
from outbox_bench.queries import query
from outbox_bench.sinks import sinks as sinks  # the sinks scenario, run by name like the others
from outbox_bench.snapshot import snapshot as snapshot  # the held snapshot, table and WAL capture
from outbox_bench.tenants import tenants as tenants  # the tenants scenario: many outboxes, one relay
from outbox_bench.verifying import verify as verify  # outbox verify's read-back, and beside a drain
from outbox_bench.workspace import STEADY_GRACE_SECONDS, SnapshotHolder, Workspace, Writers, wal_capable
from outbox_bench.writers import writer as writer  # the writer scenario, every stack

# -- drain --------------------------------------------------------------------------


# What the drain races, each in a process of its own (outbox_bench.contenders).
DRAIN_CONTENDERS: dict[str, tuple[str, dict[str, Any]]] = {
    "relay": ("relay", {}),  # this project's relay, its defaults: ordering key, archive on
    "relay_unordered": ("relay", {"ordering": "none"}),
    # A transform that returns each event unchanged, on every topic: what a transform itself costs
    "relay_transform": ("relay", {"transform": ["*=outbox_bench.transforms:noop"]}),
    # WAL capture: the same events emitted to the WAL by the same enqueue_many, read from the slot
    "relay_wal": ("relay", {}),
    # Both captures without the archive: how much of PostgreSQL's work per event is the archive's
    "relay_no_archive": ("relay", {"archive": False}),
    "relay_wal_no_archive": ("relay", {"archive": False}),
    "ceiling": ("ceiling", {}),  # the minimal loop on plain tables of its own, headers forwarded
    # The minimal loop of WAL capture: the slot streamed, each event produced, archived in a plain table
    "ceiling_wal": ("ceiling_wal", {}),
    "bare": ("bare", {}),  # the same loop on the outbox's own tables (a second reference)
    "seeds": ("seeds", {}),  # one row per transaction: the loop most teams start with
}


# The contenders that read a slot: their outbox is switched to WAL capture before the fill.
WAL_CONTENDERS = ("relay_wal", "relay_wal_no_archive", "ceiling_wal")


@dataclass(frozen=True)
class DrainCase:
    """One set-up of the drain: which events, how many, with or without statistics."""

    name: str
    title: str
    shape: str  # outbox_bench.events.SHAPES
    analyze: bool  # ANALYZE between fill and drain
    big: bool  # cfg.big_events pending instead of cfg.events
    contenders: tuple[str, ...]


PAIR = ("relay", "ceiling")
DRAIN_CASES = (
    DrainCase(
        "realistic",
        "realistic events, no statistics",
        shape="realistic",
        analyze=False,
        big=False,
        contenders=(
            "relay",
            "relay_wal",
            "relay_unordered",
            "relay_transform",
            "ceiling",
            "ceiling_wal",
            "bare",
            "seeds",
            "relay_no_archive",
            "relay_wal_no_archive",
        ),
    ),
    DrainCase(
        "analyzed",
        "realistic events, ANALYZE after the fill",
        "realistic",
        analyze=True,
        big=False,
        contenders=PAIR,
    ),
    DrainCase(
        "bytes",
        "200-byte payloads, no headers, no statistics",
        "bytes",
        analyze=False,
        big=False,
        contenders=PAIR,
    ),
    DrainCase(
        "big",
        "realistic events, larger backlog, no statistics",
        "realistic",
        analyze=False,
        big=True,
        contenders=PAIR,
    ),
)


def drain_once(cfg: BenchConfig, case: DrainCase, name: str, run: int) -> dict[str, Any]:
    if name in peers.PEERS:
        return _peer_once(cfg, name, run)
    kind, options = DRAIN_CONTENDERS[name]
    n = cfg.big_events if case.big else cfg.events
    label = f"{case.name} {name} #{run + 1}"
    with Workspace(cfg.dsn, cfg.bootstrap, f"drain_{kind}") as ws:
        if kind == "seeds":
            # About 1.7k/s: fill what it can move in its time budget, with margin.
            n = min(n, int(cfg.seeds_seconds * 4000) + 1000)
        if name in WAL_CONTENDERS:
            ws.capture_wal()
        written = ws.fill(n, label, shape=case.shape, analyze=case.analyze and kind != "ceiling")
        if kind == "ceiling":
            ws.plain_tables(analyze=case.analyze)
        elif kind == "ceiling_wal":
            ws.plain_tables(analyze=False, move=False)  # its archive; the events wait in the slot
        progress = Progress(
            f"drain {label}",
            cfg.seeds_seconds if kind == "seeds" else n,
            "s" if kind == "seeds" else " ev",
        )
        limit = cfg.seeds_seconds if kind == "seeds" else cfg.max_race_seconds
        result = race(
            [ws.spec(kind, **options)],
            target=None if kind == "seeds" else n,
            max_seconds=limit,
            progress=progress,
            boxed_from_first_move=kind == "seeds",
        )
    out = _drained(name, result, result.moved if kind == "seeds" else n)
    # What writing them cost the server (table capture: the rows, their indexes and NOTIFY; WAL
    # capture: the signed messages): the other half of an event's cost to the database.
    out["write_postgres_cpu_s_per_1k"] = round(1000 * written / max(n, 1), 4)
    return out


def _peer_once(cfg: BenchConfig, name: str, run: int) -> dict[str, Any]:
    """A peer drains the same backlog, in its own table, for ``cfg.peer_seconds``."""
    kind, options, _ = peers.PEERS[name]
    label = f"realistic {name} #{run + 1}"
    with Workspace(cfg.dsn, cfg.bootstrap, f"drain_{kind}") as ws:
        if kind == "txoutbox":
            peers.tx_fill(cfg.dsn, ws.schema, ws.topic, cfg.events, label)
        else:
            peers.fs_fill(cfg.dsn, ws.schema, cfg.events, label)
        entry = peers.tx_contender if kind == "txoutbox" else peers.fs_contender
        spec = ContenderSpec(
            kind, cfg.dsn, ws.schema, cfg.bootstrap, dict(options), topic=ws.topic, entry=entry
        )
        result = race(
            [spec],
            target=cfg.events,
            max_seconds=cfg.peer_seconds,
            progress=Progress(f"drain {label}", cfg.events, " ev"),
            boxed_from_first_move=True,
        )
    return _drained(name, result, result.moved)


def _drained(name: str, result: Any, total: int) -> dict[str, Any]:
    moved = result.moved
    rate = middle_rate(result.series, total)
    return {
        "contender": name,
        "events": moved,
        "events_per_s": round(rate, 1),
        # From the first event moved: the cost of moving them, without the start-up.
        "relay_cpu_s_per_1k": result.per_1k(result.relay_cpu_moving_s),
        "postgres_cpu_s_per_1k": result.per_1k(result.postgres_cpu_moving_s),
        "broker_cpu_s_per_1k": result.per_1k(result.broker_cpu_moving_s),
        "peak_rss_mb": round(result.peak_rss_mb, 1),
        "series": [(round(t, 3), c) for t, c in result.series],
    }


def _summary(results: list[dict[str, Any]]) -> dict[str, Any]:
    rates = [r["events_per_s"] for r in results]
    mid = sorted(results, key=lambda r: r["events_per_s"])[len(results) // 2]
    return {
        "events_per_s_median": round(median(rates), 1),
        "events_per_s_runs": rates,
        "relay_cpu_s_per_1k": mid["relay_cpu_s_per_1k"],
        "postgres_cpu_s_per_1k": mid["postgres_cpu_s_per_1k"],
        "broker_cpu_s_per_1k": mid.get("broker_cpu_s_per_1k", 0.0),
        "write_postgres_cpu_s_per_1k": mid.get("write_postgres_cpu_s_per_1k", 0.0),
        "peak_rss_mb": max(r["peak_rss_mb"] for r in results),
        "series": mid["series"],
    }


def _ratio(a: float, b: float, digits: int = 3) -> float:
    return round(a / max(b, 1e-9), digits)


_T = TypeVar("_T")


def rotated(names: tuple[_T, ...], run: int) -> tuple[_T, ...]:
    """``names`` in run ``run``'s order: each run starts one contender later, so that no
    contender always follows the same one (a checkpoint or an autovacuum that the
    previous drain set off then falls on each in turn)."""
    k = run % len(names)
    return names[k:] + names[:k]


def drain(cfg: BenchConfig) -> dict[str, Any]:
    """Every case of :data:`DRAIN_CASES`, each contender ``cfg.repeat`` times, interleaved and
    rotated (so that drift hits every contender alike). Rates: events/s over the middle 80 % of each
    run, by the parent's monotonic clock (see outbox_bench.measure)."""
    cases = [c for c in DRAIN_CASES if not (c.big and cfg.big_events <= 0)]
    skipped: dict[str, str] = {}
    if not wal_capable(cfg.dsn):
        for name in WAL_CONTENDERS:
            skipped[name] = (
                "WAL capture needs wal_level = logical and PostgreSQL 14+ (the embedded server has both)"
            )
        cases = [
            replace(c, contenders=tuple(k for k in c.contenders if k not in WAL_CONTENDERS)) for c in cases
        ]
    if absent := missing("peers"):
        skipped["peers"] = f"needs: pip install '{install('peers')}' (missing {', '.join(absent)})"
    else:
        first = cases[0]
        cases[0] = DrainCase(
            first.name,
            first.title,
            first.shape,
            first.analyze,
            first.big,
            first.contenders + tuple(peers.PEERS),
        )
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {c.name: {k: [] for k in c.contenders} for c in cases}
    for run in range(cfg.repeat):
        for case in cases:
            for name in rotated(case.contenders, run):
                runs[case.name][name].append(drain_once(cfg, case, name, run))
    out: dict[str, Any] = {"repeat": cfg.repeat, "events": cfg.events, "cases": {}, "skipped": skipped}
    for case in cases:
        summary: dict[str, Any] = {
            "title": case.title,
            "events": cfg.big_events if case.big else cfg.events,
            "contenders": {name: _summary(results) for name, results in runs[case.name].items()},
        }
        c = summary["contenders"]
        relay = c["relay"]
        summary["ratio_relay_to_ceiling"] = _ratio(
            relay["events_per_s_median"], c["ceiling"]["events_per_s_median"]
        )
        summary["cpu_ratio_relay_to_ceiling"] = _ratio(
            relay["relay_cpu_s_per_1k"], c["ceiling"]["relay_cpu_s_per_1k"]
        )
        if "bare" in c:
            summary["ratio_relay_to_bare"] = _ratio(
                relay["events_per_s_median"], c["bare"]["events_per_s_median"]
            )
        if "seeds" in c:
            summary["ratio_relay_to_seeds"] = _ratio(
                relay["events_per_s_median"], c["seeds"]["events_per_s_median"], 1
            )
        if "relay_wal" in c:
            wal = c["relay_wal"]
            summary["ratio_wal_to_table"] = _ratio(wal["events_per_s_median"], relay["events_per_s_median"])
            summary["cpu_ratio_wal_to_table"] = _ratio(wal["relay_cpu_s_per_1k"], relay["relay_cpu_s_per_1k"])
            summary["postgres_cpu_ratio_wal_to_table"] = _ratio(
                wal["postgres_cpu_s_per_1k"], relay["postgres_cpu_s_per_1k"]
            )
            # An event's whole cost to the server: written, then relayed.
            summary["postgres_cpu_written_and_relayed_wal_to_table"] = _ratio(
                wal["write_postgres_cpu_s_per_1k"] + wal["postgres_cpu_s_per_1k"],
                relay["write_postgres_cpu_s_per_1k"] + relay["postgres_cpu_s_per_1k"],
            )
            if "relay_wal_no_archive" in c and "relay_no_archive" in c:
                bare_wal, bare_table = c["relay_wal_no_archive"], c["relay_no_archive"]
                summary["postgres_cpu_ratio_wal_to_table_no_archive"] = _ratio(
                    bare_wal["postgres_cpu_s_per_1k"], bare_table["postgres_cpu_s_per_1k"]
                )
                summary["postgres_cpu_archive_wal_per_1k"] = round(
                    wal["postgres_cpu_s_per_1k"] - bare_wal["postgres_cpu_s_per_1k"], 4
                )
                summary["postgres_cpu_archive_table_per_1k"] = round(
                    relay["postgres_cpu_s_per_1k"] - bare_table["postgres_cpu_s_per_1k"], 4
                )
        if "ceiling_wal" in c:
            # What reading the WAL can do at most here, against the table relay (the target's
            # reach) and against the WAL relay (how near the relay comes to it).
            summary["ratio_wal_ceiling_to_table"] = _ratio(
                c["ceiling_wal"]["events_per_s_median"], relay["events_per_s_median"]
            )
            if "relay_wal" in c:
                summary["ratio_wal_to_wal_ceiling"] = _ratio(
                    c["relay_wal"]["events_per_s_median"], c["ceiling_wal"]["events_per_s_median"]
                )
        if "relay_transform" in c:
            summary["ratio_transform_to_relay"] = _ratio(
                c["relay_transform"]["events_per_s_median"], relay["events_per_s_median"]
            )
            summary["cpu_ratio_transform_to_relay"] = _ratio(
                c["relay_transform"]["relay_cpu_s_per_1k"], relay["relay_cpu_s_per_1k"]
            )
        if "relay_unordered" in c:
            summary["ratio_ordered_to_unordered"] = _ratio(
                relay["events_per_s_median"], c["relay_unordered"]["events_per_s_median"]
            )
        compared = {
            peer: {
                "versus": versus,
                "ratio": _ratio(c[versus]["events_per_s_median"], c[peer]["events_per_s_median"], 1),
            }
            for peer, (_, _, versus) in peers.PEERS.items()
            if peer in c
        }
        if compared:
            summary["peers"] = compared
            summary["best_peer"] = max(compared, key=lambda p: c[p]["events_per_s_median"])
        out["cases"][case.name] = summary
    if "realistic" in out["cases"] and "analyzed" in out["cases"]:
        out["ratio_no_stats_to_analyzed"] = _ratio(
            out["cases"]["realistic"]["contenders"]["relay"]["events_per_s_median"],
            out["cases"]["analyzed"]["contenders"]["relay"]["events_per_s_median"],
        )
    return out


# -- writers (steady, soak) ------------------------------------------------------------


# -- steady -----------------------------------------------------------------------------


def steady_once(
    cfg: BenchConfig, rate: int, notify: bool, capture_mode: str = "table", contender: str = "relay"
) -> dict[str, Any]:
    """One contender at ``rate`` events/s for ``steady_seconds``: when each event was committed,
    acknowledged by the broker and received by a consumer."""
    label = f"steady {rate}/s {contender} notify={'on' if notify else 'off'}" + (
        " WAL" if capture_mode == "wal" else ""
    )
    with Workspace(cfg.dsn, cfg.bootstrap, "steady") as ws, tempfile.TemporaryDirectory() as tmp:
        if capture_mode == "wal":
            ws.capture_wal()  # the writers' events are messages read from the slot: no NOTIFY
        ack_log = str(Path(tmp) / "acks.json")
        options: dict[str, Any] = {"notify": notify}
        if not notify:
            options["poll_interval"] = 0.05  # without NOTIFY, polling is the only wake-up
        if not notify:
            with psycopg.connect(cfg.dsn, autocommit=True) as conn:
                conn.execute(query("notify_trigger", ws.schema, keywords={"state": "DISABLE"}))
        spec = ws.spec("relay", **options) if contender == "relay" else ws.spec(contender)
        spec.ack_log = ack_log
        receipts = Tap(cfg.bootstrap, ws.topic, fetch_wait_ms=10)
        receipts.start()
        receipts.ready.wait(10)
        writers = Writers(ws, rate, cfg.steady_seconds, record=True)
        progress = Progress(label, cfg.steady_seconds + 5, "s")
        started: list[float] = []

        def on_sample(elapsed: float, _moved: int) -> None:
            if not started and elapsed >= 1.5:  # let the contender connect first
                started.append(elapsed)
                writers.start()

        def caught_up(_elapsed: float, moved: int) -> bool:
            # The writers' time box counts from their own start (slow to spawn on a loaded
            # machine): the contender runs until they are done and it has moved what they wrote.
            return bool(started) and not writers.alive() and moved >= writers.written

        result = race(
            [spec],
            target=None,
            max_seconds=cfg.steady_seconds + STEADY_GRACE_SECONDS,
            progress=progress,
            on_sample=on_sample,
            until=caught_up,
        )
        commits = writers.join()
        deadline = time.monotonic() + 10
        while receipts.count() < len(commits) and time.monotonic() < deadline:
            time.sleep(0.1)
        receipts.stop_event.set()
        receipts.join()
        received = dict(receipts.first_seen)
        acks = dict(json.loads(Path(ack_log).read_text())) if Path(ack_log).exists() else {}
    to_ack = [(acks[e] - t) * 1000 for e, t in commits.items() if e in acks]
    to_consumer = [(received[e] - t) * 1000 for e, t in commits.items() if e in received]
    achieved = len(commits) / cfg.steady_seconds
    acked_share = len(to_ack) / max(len(commits), 1)
    ack_p = percentiles(to_ack)
    return {
        "contender": contender,
        "target_rate": rate,
        "notify": notify,
        "capture": capture_mode,
        "written": len(commits),
        "achieved_write_rate": round(achieved, 1),
        "writer_processes": writers.n,
        "acked": len(to_ack),
        "consumed": len(to_consumer),
        "commit_to_ack_ms": ack_p,
        "commit_to_consumer_ms": percentiles(to_consumer),
        # The contender's CPU while events moved, as a share of one core.
        "cpu_share": cpu_share(result),
        # Kept up: every committed event acked, and the tail stayed bounded.
        "kept_up": acked_share >= 0.999 and (ack_p["p99"] or 0) < 1000,
        "relay_moved": result.moved,
        "latency_samples_ms": sorted(to_ack)[:: max(1, len(to_ack) // 2000)],
    }


def cpu_share(result: Race) -> float | None:
    """The contenders' CPU from their first event moved to the end, as a share of one core."""
    first = next((t for t, moved in result.series if moved > 0), None)
    if first is None or result.elapsed_s <= first:
        return None
    return round(result.relay_cpu_moving_s / (result.elapsed_s - first), 4)


def steady(cfg: BenchConfig) -> dict[str, Any]:
    """Each rate: the relay, the minimal loop (``steady_loop``) and the relay in WAL capture in
    turn, ``steady_repeat`` times, the order rotated (:func:`steady_order`); then the relay
    without NOTIFY."""
    out: list[dict[str, Any]] = []
    wal = wal_capable(cfg.dsn)
    for rate in cfg.rates:
        for i in range(cfg.steady_repeat):
            out += [
                steady_once(cfg, rate, notify=True, contender=c, capture_mode=mode)
                for c, mode in steady_order(i, wal)
            ]
    out.append(steady_once(cfg, cfg.rates[0], notify=False))
    return {"runs": out, "seconds_per_rate": cfg.steady_seconds, "compared": steady_compared(out)}


def steady_order(repeat: int, wal: bool) -> list[tuple[str, str]]:
    """The contenders of one repeat at a rate, as (contender, capture), rotated by ``repeat``: a
    drift of the machine from one run to the next hits each alike. (The WAL runs came after every
    other, minutes later.)"""
    who = (("relay", "table"), ("steady_loop", "table")) + ((("relay", "wal"),) if wal else ())
    return list(rotated(who, repeat))


def steady_compared(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate: the medians over repeats of each contender's commit -> ack p50 and p99 and its
    CPU, and the relay's (table and WAL capture, NOTIFY on) against the minimal loop's."""
    out = []
    for rate in sorted({r["target_rate"] for r in runs}):
        row: dict[str, Any] = {"rate": rate}
        for name, contender, capture in (
            ("relay", "relay", "table"), ("relay_wal", "relay", "wal"), ("loop", "steady_loop", "table")
        ):  # fmt: skip
            wanted = (rate, contender, capture, True)
            mine = [
                r for r in runs if (r["target_rate"], r["contender"], r["capture"], r["notify"]) == wanted
            ]
            if not mine:
                continue
            row[name] = {
                "p50": _median([r["commit_to_ack_ms"]["p50"] for r in mine]),
                "p99": _median([r["commit_to_ack_ms"]["p99"] for r in mine]),
                "consumer_p50": _median([r["commit_to_consumer_ms"]["p50"] for r in mine]),
                "consumer_p99": _median([r["commit_to_consumer_ms"]["p99"] for r in mine]),
                "cpu_share": _median([r["cpu_share"] for r in mine]),
                "runs": len(mine),
            }
        if "relay" in row and "loop" in row:
            row["ratio"] = {
                k: _known_ratio(row["relay"][k], row["loop"][k]) for k in ("p50", "p99", "cpu_share")
            }
        if "relay" in row and "relay_wal" in row:
            row["wal_to_table_p50"] = _known_ratio(row["relay_wal"]["p50"], row["relay"]["p50"])
        out.append(row)
    return out


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return round(median(known), 3) if known else None


def _known_ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else _ratio(a, b, 2)


# -- writer overhead: benchmarks/outbox_bench/writers.py (every stack) ------------------------------


# -- soak ---------------------------------------------------------------------------------


def soak(cfg: BenchConfig) -> dict[str, Any]:
    seconds = cfg.soak_minutes * 60
    with Workspace(cfg.dsn, cfg.bootstrap, "soak") as ws:
        writers = Writers(ws, cfg.soak_rate, seconds, record=False)
        samples: list[dict[str, Any]] = []
        # When the snapshot is taken (seconds into the load, then into the run) and released.
        snapshot_at = max(0.0, seconds / 2 - cfg.snapshot_seconds / 2)
        window: list[float] = []
        holder = SnapshotHolder(cfg.dsn, ws.schema, cfg.snapshot_seconds)  # then the table recovers
        health = query("hot_table_stats", ws.schema)
        last_sample = [-10.0]
        sample_every = max(0.5, seconds / 300)
        monitor = psycopg.connect(cfg.dsn, autocommit=True)
        drain_from: list[float] = []  # when the writers stopped: the drain phase from there
        started_at: list[float] = []

        def sample(elapsed: float, moved: int) -> None:
            if elapsed - last_sample[0] < sample_every:
                return
            last_sample[0] = elapsed
            row = monitor.execute(health, {"schema": ws.schema}).fetchone()
            dead, live, size = row if row else (0, 0, 0)
            samples.append(
                {
                    "t": round(elapsed, 2),
                    "phase": "drain" if drain_from else "load",
                    "table_bytes": int(size),
                    "live_tuples": int(live),
                    "dead_tuples": int(dead),
                    "written": writers.written,
                    "delivered": moved,
                }
            )

        def on_sample(elapsed: float, moved: int) -> None:
            if not started_at and elapsed >= 1.5:
                started_at.append(elapsed)
                writers.start()
            if started_at and not window and elapsed - started_at[0] >= snapshot_at:
                holder.start()
                window.extend([elapsed, elapsed + cfg.snapshot_seconds])
            if started_at and not writers.alive() and not drain_from:
                drain_from.append(elapsed)
            sample(elapsed, moved)

        def settled(elapsed: float, moved: int) -> bool:
            # The writers' load counts from their own start (slow to spawn on a loaded machine):
            # the relay runs until it has moved what they wrote and the settle time has passed.
            return (
                bool(drain_from)
                and moved >= writers.written
                and elapsed - drain_from[0] >= cfg.settle_seconds
            )

        total = seconds + cfg.settle_seconds + 2
        progress = Progress("soak", total, "s")
        result = race(
            [ws.spec("relay")],
            target=None,
            max_seconds=total + STEADY_GRACE_SECONDS,
            progress=progress,
            on_sample=on_sample,
            until=settled,
        )
        writers.join()
        holder.release()
        final = monitor.execute(health, {"schema": ws.schema}).fetchone()
        monitor.close()
    peak = max((s["table_bytes"] for s in samples), default=0)
    final_bytes = int(final[2]) if final else 0
    return {
        "minutes": cfg.soak_minutes,
        "rate": cfg.soak_rate,
        "snapshot_seconds": cfg.snapshot_seconds,
        "snapshot_window_s": window or [None, None],
        "written": writers.written,
        "delivered": result.moved,
        "peak_table_bytes": peak,
        "final_table_bytes": final_bytes,
        # Near zero: back to at most a few pages, or a tenth of the peak.
        "returned_near_zero": final_bytes <= max(1 << 20, peak // 10),
        "series_relay": [(round(t, 2), c) for t, c in result.series],
        "samples": samples,
    }


# -- scale ----------------------------------------------------------------------------------


def scale(cfg: BenchConfig) -> dict[str, Any]:
    out = []
    for ordering in ("key", "none"):
        for k in cfg.scale_processes:
            with Workspace(cfg.dsn, cfg.bootstrap, f"scale{k}") as ws:
                ws.fill(cfg.events, f"scale x{k} {ordering}")
                progress = Progress(f"scale {k} relay(s) ordering={ordering}", cfg.events, " ev")
                specs = [ws.spec("relay", ordering=ordering) for _ in range(k)]
                result = race(specs, target=cfg.events, max_seconds=cfg.max_race_seconds, progress=progress)
            rate = middle_rate(result.series, cfg.events)
            cpu = result.relay_cpu_s + result.postgres_cpu_s
            out.append(
                {
                    "processes": k,
                    "ordering": ordering,
                    "events_per_s": round(rate, 1),
                    "events_per_cpu_s": round(result.moved / max(cpu, 1e-9), 1),
                    "relay_cpu_s": round(result.relay_cpu_s, 2),
                    "postgres_cpu_s": round(result.postgres_cpu_s, 2),
                }
            )
    return {"runs": out, "events": cfg.events}
