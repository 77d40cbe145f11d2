"""`outbox bench --smoke`: every scenario runs and writes its outputs. No timing is asserted.

The scenarios run in four groups, each its own `outbox bench` process, so that a parallel
suite spreads them over its workers; together they cover every scenario.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from outbox_bench.config import SCENARIOS

GROUPS = [
    ("drain",), ("steady", "writer", "tenants"), ("soak", "scale", "snapshot"), ("sinks", "console", "limits", "verify"),
]  # fmt: skip


# Each runs a whole `outbox bench` process with a timeout of its own (600 s), which says what it
# was doing: pytest's default 300 s would cut it short first when it shares the cores (CI runs
# them beside the rest of the suite).
pytestmark = pytest.mark.timeout(660)


def test_the_groups_cover_every_scenario_once() -> None:
    assert sorted(s for g in GROUPS for s in g) == sorted(SCENARIOS)


def _bench(pg_dsn: str, kafka: str, out: Path, scenarios: tuple[str, ...]) -> tuple[dict[str, Any], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "outbox", "bench", "--smoke", "--scenarios", ",".join(scenarios),
         "--dsn", pg_dsn, "--kafka-bootstrap", kafka, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| relay" not in proc.stderr  # progress goes to stderr, the table to stdout
    assert "Run " in proc.stdout and " cores" in proc.stdout  # the report, with its machine
    results = json.loads((out / "results.json").read_text())
    assert set(results["scenarios"]) == set(scenarios)
    assert results["machine"]["cores"] and results["machine"]["postgresql"]
    return results, (out / "results.md").read_text()


def _png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", path.name


@pytest.mark.slow
def test_bench_smoke_drain(pg_dsn: str, kafka: str, tmp_path: Path) -> None:
    results, table = _bench(pg_dsn, kafka, tmp_path, ("drain",))
    drain = results["scenarios"]["drain"]
    assert set(drain["cases"]) == {"realistic", "analyzed", "bytes", "big"}
    assert drain["cases"]["big"]["events"] > drain["cases"]["realistic"]["events"]
    for case in drain["cases"].values():
        for kind, r in case["contenders"].items():
            assert r["events_per_s_median"] > 0, kind
            assert r["series"], "no time series recorded"
        ceiling = case["contenders"]["ceiling"]["events_per_s_median"]
        assert case["ratio_relay_to_ceiling"] == round(
            case["contenders"]["relay"]["events_per_s_median"] / ceiling, 3
        )
    realistic = drain["cases"]["realistic"]["contenders"]
    peers = {
        "txoutbox",
        "txoutbox_unordered",
        "faststream_outbox",
    }  # the dev extras hold outbox-relay-bench[peers]'s packages
    # WAL capture races too: the suite's server runs with wal_level = logical (scripts/bootstrap).
    captures = {
        "relay",
        "relay_wal",
        "relay_unordered",
        "relay_transform",
        "ceiling",
        "ceiling_wal",
        "bare",
        "seeds",
    }
    assert set(realistic) == captures | {"relay_no_archive", "relay_wal_no_archive"} | peers
    case = drain["cases"]["realistic"]
    assert case["ratio_wal_to_table"] > 0 and case["ratio_wal_ceiling_to_table"] > 0
    # Issue 59: CPU per event, WAL against table capture, and the archive's share of PostgreSQL's
    # (a smoke drain of 3,000 events lasts a few samples: the CPU after the first move may round
    # to 0 at the clock's 10 ms ticks, so only their presence is checked here).
    for name in ("cpu_ratio_wal_to_table", "postgres_cpu_ratio_wal_to_table"):
        assert isinstance(case[name], float) and case[name] >= 0, name
    assert case["postgres_cpu_ratio_wal_to_table_no_archive"] >= 0
    # The write's cost to the server, read from the fill session's own process (a local server).
    assert realistic["relay"]["write_postgres_cpu_s_per_1k"] > 0
    assert case["postgres_cpu_written_and_relayed_wal_to_table"] > 0
    compared = drain["cases"]["realistic"]["peers"]
    assert set(compared) == peers and drain["cases"]["realistic"]["best_peer"] in peers
    assert compared["txoutbox"]["versus"] == "relay"  # strict ordering against our default
    assert "ratio_no_stats_to_analyzed" in drain
    _png(tmp_path / "drain_throughput.png")
    assert "outbox relay" in table and "plain tables (ceiling)" in table and "hand-written loop" in table
    assert "on the outbox's tables" in table and "middle 80 %" in table and "events/s" in table
    assert "WAL capture (read from the slot)" in table and "WAL capture / table capture" in table
    assert "(WAL ceiling)" in table and "WAL relay / WAL ceiling" in table
    assert "CPU per event WAL / table capture: the relay" in table and "without the archive" in table
    assert "WAL capture, --no-archive" in table and "start-up excluded" in table
    assert "written and relayed WAL / table capture" in table
    # Issue 60: what a transform costs, against the relay's own drain in the same run.
    assert case["ratio_transform_to_relay"] > 0 and "a no-op transform: **" in table


@pytest.mark.slow
def test_bench_smoke_steady_writer_and_tenants(pg_dsn: str, kafka: str, tmp_path: Path) -> None:
    results, table = _bench(pg_dsn, kafka, tmp_path, ("steady", "writer", "tenants"))
    for run in results["scenarios"]["steady"]["runs"]:
        assert run["acked"] == run["written"] > 0, "steady: an event was not acked"
        assert run["consumed"] == run["written"], "steady: an event was not consumed"
    steady = results["scenarios"]["steady"]
    assert [(r["contender"], r["capture"], r["notify"]) for r in steady["runs"]] == [
        ("relay", "table", True), ("steady_loop", "table", True), ("relay", "wal", True), ("relay", "table", False)
    ]  # fmt: skip
    (compared,) = steady["compared"]
    assert compared["rate"] == 200 and compared["ratio"]["p50"] > 0 and compared["wal_to_table_p50"] > 0
    assert all(r["cpu_share"] > 0 for r in steady["runs"]), "steady: a contender's CPU was not measured"
    assert "| WAL capture (streamed) |" in table and "| minimal loop | 200/s | NOTIFY |" in table
    assert "against the minimal loop with archive" in table
    writer = results["scenarios"]["writer"]
    assert writer["stacks"], "writer: no stack measured"
    assert set(writer["stacks_wal"]) == set(writer["stacks"]), "writer: WAL capture not measured per stack"
    assert ", WAL capture | – |" in table
    _png(tmp_path / "steady_latency.png")
    tenants = results["scenarios"]["tenants"]
    assert [r["outboxes"] for r in tenants["runs"]] == [1, 10]
    for r in tenants["runs"]:
        assert r["stopped"] is None and r["warm_events_per_s"], r
        assert r["events_per_s"] > 0 and r["idle_transactions_per_s"] > 0, r
    assert tenants["runs"][0]["ratio_to_one"] == 1.0
    fair = tenants["fairness"]
    assert fair["busy_events_per_s"] > 0 and fair["quiet_latency_ms"]["n"] == fair["quiet_events"]
    assert "**Tenants**" in table and "**Fairness**" in table
    _png(tmp_path / "tenants.png")


@pytest.mark.slow
def test_bench_smoke_soak_scale_and_snapshot(pg_dsn: str, kafka: str, tmp_path: Path) -> None:
    results, table = _bench(pg_dsn, kafka, tmp_path, ("soak", "scale", "snapshot"))
    snap = results["scenarios"]["snapshot"]
    # Each mode under the held snapshot, then its control with none held (the suite's server is
    # logical, so both modes run).
    assert [(r["capture"], r["held"]) for r in snap["runs"]] == [
        ("table", True), ("table", False), ("wal", True), ("wal", False)
    ]  # fmt: skip
    for r in snap["runs"]:
        assert r["delivered"] >= r["written"] > 0 and r["all_acked"], r["capture"]
        # A short run times every event's ack, in whichever window it was written: beside the
        # loaded suite a writer made 3 events/s, and a sixteenth of them left windows empty.
        assert r["acks_kept"] == "all" and len(r["windows"]) == 5, r["windows"]
        assert [w["acked_sampled"] for w in r["windows"]] == [w["written"] for w in r["windows"]]
        assert r["samples"] and r["p99_worst_to_first"] is not None
    wal = snap["runs"][2]
    assert wal["slot_retained_peak_bytes"] > 0  # the slot was looked at
    assert wal["table_bytes_peak"] <= snap["runs"][0]["table_bytes_peak"]  # WAL events touch no table
    # The held runs are judged against their controls' worst minute as well.
    assert all(r["worst_to_control_worst"] is not None for r in snap["runs"] if r["held"])
    assert "**Snapshot**" in table and "| wal |" in table and "| wal, none held |" in table
    _png(tmp_path / "snapshot.png")
    soak = results["scenarios"]["soak"]
    assert soak["delivered"] == soak["written"] > 0
    assert soak["samples"]
    runs = results["scenarios"]["scale"]["runs"]
    assert [(r["processes"], r["ordering"]) for r in runs] == [
        (1, "key"),
        (2, "key"),
        (1, "none"),
        (2, "none"),
    ]
    _png(tmp_path / "soak.png")
    _png(tmp_path / "scale.png")


@pytest.mark.slow
def test_bench_smoke_sinks_console_and_limits(pg_dsn: str, kafka: str, tmp_path: Path) -> None:
    results, table = _bench(pg_dsn, kafka, tmp_path, ("sinks", "console", "limits", "verify"))
    verify = results["scenarios"]["verify"]
    assert verify["read_back"]["events_per_s_median"] > 0 and verify["events"] == 3000
    assert all(p["with"]["read_back_meanwhile"] > 0 and p["without"]["read_back_meanwhile"] == 0
               and p["sampled"]["events"] == 3000 for p in verify["beside"]["pairs"])  # fmt: skip
    assert "**Verify**" in table
    _png(tmp_path / "verify.png")
    limits = results["scenarios"]["limits"]
    assert [set(p) for p in limits["beside"]["pairs"]] == [{"without", "with"}]
    assert all(p["without"] > 0 and p["with"] > 0 for p in limits["beside"]["pairs"])
    assert limits["across"]["requests_per_s"] > 0 and sum(limits["across"]["per_second"]) >= 100
    assert limits["weights"]["events"] == 3000  # a smoke's backlogs drain too fast for a share
    assert "**Limits**" in table and "**Rate across relays**" in table
    _png(tmp_path / "limits.png")
    sinks = results["scenarios"]["sinks"]["sinks"]
    assert set(sinks) == {"amqp", "nats", "redis", "http"}
    for r in sinks.values():  # every sink drained by both, the ratio computed from the same run
        assert r["relay_events_per_s_median"] > 0 and r["loop_events_per_s_median"] > 0
        assert r["ratio_relay_to_loop"] == round(
            r["relay_events_per_s_median"] / r["loop_events_per_s_median"], 3
        )
    _png(tmp_path / "sinks.png")
    assert "| amqp |" in table and "| http |" in table
    # The console's pages, each answered (a page that is not a 200 fails the scenario) and
    # timed, at the size the bench filled.
    console = results["scenarios"]["console"]
    assert console["sizes"]["pending"] == 3000 and console["sizes"]["archived"] == 20_000
    assert console["sizes"]["dead_letters"] == 500
    assert len(console["pages"]) == 16
    assert all(p["p50_ms"] > 0 and p["p95_ms"] >= p["p50_ms"] for p in console["pages"].values())
    _png(tmp_path / "console.png")
    assert "| a key's timeline |" in table


def test_a_sink_the_bench_cannot_use_is_refused_in_one_line_before_any_work(tmp_path: Path) -> None:
    """No endpoint on an AWS URL: the bench would create queues in the account itself."""
    proc = subprocess.run(
        [sys.executable, "-m", "outbox", "bench", "--scenarios", "sinks", "--sinks", "sqs://orders?region=eu-west-1",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "'sqs://orders?region=eu-west-1' needs ?endpoint=" in proc.stderr
    assert "starting embedded" not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_bench_smoke_sinks_on_aws(pg_dsn: str, kafka: str, moto_server: Any, aws_env: dict[str, str],
                                  tmp_path: Path) -> None:  # fmt: skip
    """The AWS entries of the sinks scenario, on moto: each service drained by the relay and by
    its minimal aiobotocore loop in the same run (a small drain: moto's SQS slows as queues fill)."""
    endpoint = f"endpoint={moto_server.endpoint}&region=us-east-1"
    urls = [f"{s}://bench?{endpoint}" for s in ("sqs", "sns", "eventbridge", "kinesis")]
    proc = subprocess.run(
        [sys.executable, "-m", "outbox", "bench", "--smoke", "--scenarios", "sinks", "--sink-events", "100",
         *(a for url in urls for a in ("--sinks", url)), "--dsn", pg_dsn, "--kafka-bootstrap", kafka,
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sinks = json.loads((tmp_path / "results.json").read_text())["scenarios"]["sinks"]["sinks"]
    assert set(sinks) == {"sqs", "sns", "eventbridge", "kinesis"}
    for r in sinks.values():
        assert r["relay_events_per_s_median"] > 0 and r["loop_events_per_s_median"] > 0, r
    assert "| kinesis |" in proc.stdout
    assert "Found credentials" not in proc.stderr  # botocore's INFO line, once per client, stays quiet


def test_big_events_zero_leaves_the_larger_backlog_out_and_a_negative_one_is_named() -> None:
    """--big-events 0 is what its help says skips the larger backlog; it was refused as not > 0."""

    def bench(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "outbox", "bench", "--scenarios", "nothing", *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    zero = bench("--big-events", "0")
    assert zero.returncode == 2 and "--scenarios: unknown ['nothing']" in zero.stderr, zero.stderr
    negative = bench("--big-events", "-1")
    assert negative.returncode == 2 and "--big-events: must be > 0, got -1" in negative.stderr, (
        negative.stderr
    )
