"""The tenants scenario: one relay process over many outboxes (schemas) of one database.

- **Spread.** The same backlog (``tenants_events`` realistic events) spread evenly over 1, 10,
  100 and 1,000 outboxes, drained by one ``outbox relay`` serving them all: events/s over the
  middle 80 % and the ratio to the single outbox (target: >= 0.8 at 100 and at 1,000 outboxes).
  Then the relay idles for ``tenants_idle_seconds`` with nothing to do: the transactions per
  second it costs the database (``pg_stat_database``), per outbox (target at 1,000: <= 0.05), and
  its CPU (target at 1,000: <= 3 % of a core); and its peak RSS, per outbox beyond the first.
- **Fairness.** One outbox with a backlog of ``tenants_busy`` events and a quiet one written at
  ``tenants_quiet_rate`` events/s while the busy one drains: the quiet one's commit -> ack
  latency (its writer's commit returned -> the broker's ack reached the relay; p50, p99; target
  p99 <= 100 ms), next to the busy one's drain rate.

Each relay runs as ``outbox relay`` does (its defaults, NOTIFY on), in a process of its own.
"""

from __future__ import annotations

import itertools
import json
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg

from outbox import enqueue, enqueue_many
from outbox.harness.infra import create_topic
from outbox.observe.progress import Progress
from outbox.store.migrate import PER_CONNECTION, migrate
from outbox.store.outboxes import Outbox
from outbox_bench.config import BenchConfig
from outbox_bench.contenders import ContenderSpec
from outbox_bench.events import FILL_CHUNK, realistic
from outbox_bench.measure import Race, middle_rate, percentiles, race
from outbox_bench.queries import query

FLEET_PAGE_FROM = 100  # outboxes: from this spread on, the console's fleet page is timed too
FLEET_PAGE_REQUESTS = 20
MIGRATORS = 4  # schemas migrated at once while the scenario sets up
AUTOVACUUM_WAIT = 300.0  # seconds the idle window waits, at most, for autovacuum's workers
TOPIC_PARTITIONS = 4


class Tenants:
    """``n`` freshly migrated schemas and one topic, dropped at the end."""

    def __init__(self, dsn: str, bootstrap: str, n: int) -> None:
        self.dsn, self.bootstrap = dsn, bootstrap
        suffix = uuid.uuid4().hex[:8]
        self.schemas = [f"bench_tn_{suffix}_{i:04d}" for i in range(n)]
        self.topic = f"bench.tenants.{suffix}"

    def __enter__(self) -> Tenants:
        progress = Progress(f"migrate {len(self.schemas)} outboxes", len(self.schemas), "")
        done = itertools.count(1)

        def migrated(conn: psycopg.Connection[Any], schema: str) -> None:
            migrate(conn, schema)
            progress.update(next(done))

        self._each_schema(migrated)  # the set-up's time, not the relay's
        progress.close()
        create_topic(self.bootstrap, self.topic, TOPIC_PARTITIONS)
        return self

    def __exit__(self, *exc: object) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for schema in self.schemas:
                conn.execute(query("harness_drop_schema", schema))

    def vacuum(self) -> None:
        """Autovacuum's work after a drain, done now (VACUUM ANALYZE of every outbox's tables):
        its transactions, a few per table for minutes after a drain of 1,000 outboxes, are the
        database's upkeep after any write load, not the idle relay's."""
        self._each_schema(lambda conn, schema: conn.execute(query("bench_vacuum_outbox", schema)))

    def _each_schema(self, work: Callable[[psycopg.Connection[Any], str], object]) -> None:
        """``work(conn, schema)`` for every schema, on MIGRATORS sessions at once, each replaced by
        a fresh one every PER_CONNECTION schemas (a session's DDL slows with what it has done)."""

        def share(k: int) -> None:
            mine = self.schemas[k::MIGRATORS]
            for start in range(0, len(mine), PER_CONNECTION):
                with psycopg.connect(self.dsn, autocommit=True) as conn:
                    for schema in mine[start : start + PER_CONNECTION]:
                        work(conn, schema)

        with ThreadPoolExecutor(MIGRATORS) as pool:
            list(pool.map(share, range(MIGRATORS)))

    def fill_at_once(self, per_outbox: int) -> None:
        """``per_outbox`` realistic events in every schema, committed in one transaction: a relay
        that serves them finds them all at once (the warm drain)."""
        with psycopg.connect(self.dsn) as conn:
            for schema in self.schemas:
                for start in range(0, per_outbox, FILL_CHUNK):
                    end = min(per_outbox, start + FILL_CHUNK)
                    enqueue_many(conn, [realistic(i, self.topic) for i in range(start, end)], schema=schema)
            conn.commit()

    def fill(self, per_outbox: int, label: str, schemas: list[str] | None = None) -> None:
        """``per_outbox`` realistic events in each schema (of ``schemas``, default all)."""
        chosen = self.schemas if schemas is None else schemas
        progress = Progress(f"fill {label}", per_outbox * len(chosen), " ev")
        done = 0
        with psycopg.connect(self.dsn) as conn:
            for schema in chosen:
                for start in range(0, per_outbox, FILL_CHUNK):
                    end = min(per_outbox, start + FILL_CHUNK)
                    enqueue_many(conn, [realistic(i, self.topic) for i in range(start, end)], schema=schema)
                    conn.commit()
                    done += end - start
                    progress.update(done)
        progress.close()

    def spec(self, schemas: list[str] | None = None) -> ContenderSpec:
        chosen = self.schemas if schemas is None else schemas
        return ContenderSpec("relay", self.dsn, chosen[0], self.bootstrap, {}, schemas=chosen)


def _autovacuum_busy(dsn: str) -> bool:
    """Is an autovacuum worker at work in the database now?"""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query("bench_autovacuum_busy", "public")).fetchone()
    return bool(row and row[0])


def _transactions(dsn: str) -> int:
    """Transactions committed and rolled back in the database so far (pg_stat_database)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query("bench_database_transactions", "public")).fetchone()
    return int(row[0]) if row else 0


def _serve(
    ws: Tenants,
    cfg: BenchConfig,
    progress: Progress,
    on_sample: Callable[[float, int], None],
    until: Callable[[float, int], bool],
    ack_log: str | None = None,
    max_seconds: float | None = None,
) -> Race:
    """One relay over every outbox of ``ws`` until ``until`` says so (events counted), or
    ``max_seconds`` (default: a race's) passed; with ``ack_log``, it writes there when each
    event's ack arrived."""
    spec = ws.spec()
    spec.ack_log = ack_log
    return race(
        [spec],
        target=None,
        max_seconds=cfg.max_race_seconds if max_seconds is None else max_seconds,
        progress=progress,
        on_sample=on_sample,
        until=until,
        counting=True,
    )


def spread(cfg: BenchConfig, n: int) -> dict[str, Any]:
    """The backlog over ``n`` outboxes: the drain (the relay's first look at each outbox), the
    idle relay's cost, then the same backlog again, committed at once, drained by the same relay
    (warm: its sessions have read every outbox's tables and plans before, as a relay that has run
    a while has)."""
    with Tenants(cfg.dsn, cfg.bootstrap, n) as ws:
        per = max(1, cfg.tenants_events // n)
        total = per * n
        ws.fill(per, f"{n} outboxes")
        progress = Progress(f"tenants: {n} outboxes", 2 * total, " ev")
        idle: dict[str, float] = {}
        refill = threading.Thread(target=ws.fill_at_once, args=(per,), name="refill", daemon=True)
        vacuum = threading.Thread(target=ws.vacuum, name="vacuum", daemon=True)

        def on_sample(elapsed: float, moved: int) -> None:
            # Drained: the drain's tables vacuumed and analyzed (autovacuum would do it over the next
            # minutes, and its transactions are the database's, not the relay's), and no autovacuum
            # worker busy, the idle window opens: the relay's own transactions.
            if moved >= total and "drained" not in idle:
                idle["drained"] = elapsed
                vacuum.start()
            elif "drained" in idle and "from" not in idle and not vacuum.is_alive():
                # Its own vacuum done, however long it took (15,000 tables at 5,000 outboxes took
                # longer than the wait below, and its transactions fell in the window), it waits
                # for autovacuum's workers, AUTOVACUUM_WAIT at most.
                vacuumed = idle.setdefault("vacuumed", elapsed)
                if elapsed - vacuumed >= AUTOVACUUM_WAIT or not _autovacuum_busy(cfg.dsn):
                    idle["from"], idle["xacts"] = elapsed, float(_transactions(cfg.dsn))
            elif "from" in idle and "to" not in idle and elapsed - idle["from"] >= cfg.tenants_idle_seconds:
                idle["to"], idle["xacts_to"] = elapsed, float(_transactions(cfg.dsn))
                refill.start()
            elif "to" in idle and "committed" not in idle and not refill.is_alive():
                idle["committed"] = elapsed

        def until(elapsed: float, moved: int) -> bool:
            if "committed" in idle and moved >= 2 * total:
                return True
            # Each phase gets a race's time (600 s): at 5,000 outboxes the vacuum of 15,000 tables
            # outlasted one cap over them all, and the warm drain and the idle window were not run.
            phase, since = _phase(idle)
            if elapsed - since > cfg.max_race_seconds:
                stopped.append(f"{phase} took longer than {cfg.max_race_seconds:g} s")
                return True
            return False

        stopped: list[str] = []
        phases = 4 * cfg.max_race_seconds + AUTOVACUUM_WAIT + cfg.tenants_idle_seconds  # a backstop
        result = _serve(ws, cfg, progress, on_sample, until, max_seconds=phases + 60.0)
        for helper in (vacuum, refill):  # a stopped run's: done before its schemas are dropped
            if helper.is_alive():
                helper.join()
        window = max(idle.get("to", result.elapsed_s) - idle.get("from", result.elapsed_s), 1e-9)
        cpu_at = dict(result.cpu_series)
        cpu_from = next((c for t, c in result.cpu_series if t >= idle.get("from", result.elapsed_s)), 0.0)
        cpu_to = next((c for t, c in result.cpu_series if t >= idle.get("to", result.elapsed_s)), cpu_from)
        idle_cpu = max(0.0, cpu_to - cpu_from) if cpu_at else 0.0
        xacts = idle.get("xacts_to", 0.0) - idle.get("xacts", 0.0)
        fleet_page = fleet_page_ms(cfg, ws.schemas) if n >= FLEET_PAGE_FROM else None
    # Rates over the middle 80 % of each drain (the idle window is in neither).
    first = [(t, m) for t, m in result.series if t <= idle.get("drained", result.elapsed_s) + 0.5]
    start = idle.get("committed", result.elapsed_s)
    warm = [(t, m - total) for t, m in result.series if t >= start - 0.5 and m >= total]
    if not stopped and result.moved < 2 * total:
        stopped.append(f"the race stopped after {result.elapsed_s:.0f} s")
    idled = "to" in idle  # a stopped run measures what it finished, and says what it did not
    return {
        "outboxes": n,
        "events": total,
        "events_per_s": round(middle_rate(first, total), 1) if "drained" in idle else None,
        "warm_events_per_s": round(middle_rate(warm, total), 1) if result.moved >= 2 * total else None,
        "peak_rss_mb": round(result.peak_rss_mb, 1),
        "idle_seconds": round(window, 1) if idled else None,
        "idle_transactions_per_s": round(xacts / window, 1) if idled else None,
        "idle_transactions_per_s_per_outbox": round(xacts / window / n, 4) if idled else None,
        "relay_cpu_s": round(result.relay_cpu_s, 2),
        "idle_cpu_percent": round(100 * idle_cpu / window, 2) if idled else None,
        "series": [(round(t, 3), c) for t, c in first],
        "fleet_page_ms": fleet_page,
        "stopped": stopped[0] if stopped else None,
    }


def _phase(idle: dict[str, float]) -> tuple[str, float]:
    """The spread's phase now, and when it began (seconds into the race), from its marks."""
    if "drained" not in idle:
        return "the drain", 0.0
    if "vacuumed" not in idle:
        return "the vacuum of the drained tables", idle["drained"]
    if "from" not in idle:
        return "the wait for autovacuum", idle["vacuumed"]
    if "to" not in idle:
        return "the idle window", idle["from"]
    if "committed" not in idle:
        return "the refill", idle["to"]
    return "the warm drain", idle["committed"]


def fleet_page_ms(cfg: BenchConfig, schemas: list[str]) -> dict[str, float] | None:
    """The console's fleet page over these outboxes: the first request (it prepares each
    outbox's statement), then p50 and p95 of FLEET_PAGE_REQUESTS more (None without
    ``outbox-relay[console]``)."""
    try:
        from starlette.testclient import TestClient

        from outbox.console import app
    except ImportError:
        return None
    outboxes = [Outbox(s, cfg.dsn, s) for s in schemas]
    times = []
    with TestClient(app(outboxes=outboxes), base_url="http://localhost") as client:
        start = time.perf_counter()
        client.get("/")  # the first prepares each outbox's statement on the page's connection
        first = (time.perf_counter() - start) * 1000
        for _ in range(FLEET_PAGE_REQUESTS):
            start = time.perf_counter()
            if client.get("/").status_code != 200:
                raise RuntimeError("the console's fleet page did not answer 200")
            times.append((time.perf_counter() - start) * 1000)
    p = percentiles(times)
    return {
        "first": round(first, 1),
        "p50": round(p["p50"] or 0.0, 1),
        "p95": round(p["p95"] or 0.0, 1),
        "outboxes": len(schemas),
    }


def fairness(cfg: BenchConfig) -> dict[str, Any]:
    """A busy outbox draining ``tenants_busy`` events and a quiet one written at
    ``tenants_quiet_rate`` events/s meanwhile: the quiet one's commit -> ack latency."""
    with Tenants(cfg.dsn, cfg.bootstrap, 2) as ws, tempfile.TemporaryDirectory() as tmp:
        busy, quiet = ws.schemas
        ws.fill(cfg.tenants_busy, "the busy outbox", [busy])
        commits: dict[str, float] = {}  # the quiet outbox's event id -> when its writer's commit returned
        stop = threading.Event()
        started = threading.Event()

        def write_quietly() -> None:
            with psycopg.connect(cfg.dsn, autocommit=True) as conn:
                while not stop.wait(1 / cfg.tenants_quiet_rate):
                    n = len(commits)
                    with conn.transaction():
                        event_id = enqueue(conn, ws.topic, {"quiet": n}, key=f"quiet-{n % 10}", schema=quiet)
                    commits[str(event_id)] = time.time()

        writer = threading.Thread(target=write_quietly, name="quiet-writer", daemon=True)

        def on_sample(elapsed: float, moved: int) -> None:
            if moved > 0 and not started.is_set():  # the busy drain is under way: the quiet one writes
                started.set()
                writer.start()
            if moved >= cfg.tenants_busy and not stop.is_set():
                stop.set()

        def until(elapsed: float, moved: int) -> bool:
            return stop.is_set() and not writer.is_alive() and moved >= cfg.tenants_busy + len(commits)

        progress = Progress("tenants: fairness", cfg.tenants_busy, " ev")
        ack_log = str(Path(tmp) / "acks.json")
        result = _serve(ws, cfg, progress, on_sample, until, ack_log=ack_log)
        stop.set()
        writer.join(10)
        acks = dict(json.loads(Path(ack_log).read_text())) if Path(ack_log).exists() else {}
    # Commit (the writer's commit returned) -> ack (the broker's acknowledgement reached the relay).
    latencies = [(acks[e] - t) * 1000 for e, t in commits.items() if e in acks]
    busy_series = [(t, min(m, cfg.tenants_busy)) for t, m in result.series]
    return {
        "busy_events": cfg.tenants_busy,
        "busy_events_per_s": round(middle_rate(busy_series, cfg.tenants_busy), 1),
        "quiet_rate": cfg.tenants_quiet_rate,
        "quiet_events": len(commits),
        "quiet_acked": len(latencies),
        "quiet_latency_ms": percentiles(latencies),
    }


def tenants(cfg: BenchConfig) -> dict[str, Any]:
    runs = [spread(cfg, n) for n in cfg.tenants_counts]
    single = next((r for r in runs if r["outboxes"] == 1), None)
    for r in runs:
        r["ratio_to_one"] = _ratio(r, single, "events_per_s")
        r["warm_ratio_to_one"] = _ratio(r, single, "warm_events_per_s")
    one_rss = single["peak_rss_mb"] if single else None
    for r in runs:
        more = r["outboxes"] - 1
        r["rss_mb_per_outbox"] = (
            round((r["peak_rss_mb"] - one_rss) / more, 3) if one_rss and more > 0 else None
        )
    return {"events": cfg.tenants_events, "runs": runs, "fairness": fairness(cfg)}


def _ratio(run: dict[str, Any], single: dict[str, Any] | None, key: str) -> float | None:
    """``run``'s ``key`` over the single outbox's (None when either was not measured)."""
    if single is None or not run[key] or not single[key]:
        return None
    return round(float(run[key]) / float(single[key]), 3)
