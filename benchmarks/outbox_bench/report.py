"""The benchmark's outputs: results.json, a Markdown table, PNG plots."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from outbox_bench import verifying

TARGETS = {
    "relay_vs_ceiling": 0.8,  # relay drain >= 0.8 x the minimal loop on plain tables (every case)
    "cpu_vs_ceiling": 1.3,  # relay CPU per event <= 1.3 x the minimal loop's
    "no_stats_vs_analyzed": 0.9,  # the drain without statistics within 10 % of the one after ANALYZE
    "relay_vs_seeds": 35.0,  # relay drain >= 35 x the hand-written loop
    "ack_p50_ms_at_1k": 10.0,
    "ack_p99_ms_at_1k": 50.0,
    "enqueue_overhead_p50_ms": 0.3,
    "enqueue_many_1000_ms": 20.0,
    "relay_rss_mb": 150.0,
    "relay_vs_best_peer": 10.0,  # the relay >= 10 x the fastest Python peer
    "relay_vs_sink_loop": 0.8,  # each sink: relay drain >= 0.8 x its minimal loop
    "console_page_p95_ms": 300.0,  # every console page at the full size (issue 27)
    "wal_vs_table": 1.5,  # WAL capture's drain >= 1.5 x the table relay's (issue 30)
    "transform_vs_relay": 0.9,  # a no-op transform on every event costs <= 10 % of the drain (issue 60)
    "wal_vs_wal_ceiling": 0.85,  # ... and >= 0.85 x its own minimal loop (issue 59)
    "wal_postgres_cpu_vs_table": 0.6,  # PostgreSQL's CPU per event, WAL / table capture <= 0.6 (59)
    "wal_relay_cpu_vs_table": 1.2,  # the relay's CPU per event, WAL / table capture <= 1.2 (59)
    "snapshot_p99_flat": 1.10,  # under a held snapshot: every minute's p99 <= 1.1 x the first's (issue 30)
    "tenants_ratio": 0.8,  # the backlog over 100 and over 1,000 outboxes >= 0.8 x over one (28, 45)
    "tenants_idle_cpu_percent": 3.0,  # the idle relay at 1,000 outboxes: <= 3 % of a core (issue 45)
    "tenants_idle_tx_per_outbox": 0.05,  # ... and <= 0.05 transactions/s per outbox (issue 45)
    "tenants_quiet_p99_ms": 100.0,  # a quiet outbox's commit -> ack p99 while a busy one drains
    "limits_beside": 0.9,  # an unlimited route's drain beside a limited backlog >= 0.9 x without (45)
    "limits_rate_tolerance": 0.10,  # a limit's rate across two relays within 10 % (issue 45)
}
RATIO_AT = (100, 1000)  # outboxes: the spreads whose ratio to one outbox has a target
IDLE_AT = 1000  # outboxes: the spread whose idle cost has targets
FAIRNESS_SAMPLES = 100  # quiet events acked, at least, for the fairness p99 to be judged


def _ms(v: float | None) -> str:
    return "–" if v is None else f"{v:.2f}"


def _verdict(ok: bool) -> str:
    return "met" if ok else "**missed**"


def _against(value: float, target: str, *, most: bool = False) -> str:
    """``(target ≥ 0.8: met)`` for ``value`` against ``TARGETS[target]`` (``most``: ≤)."""
    limit = TARGETS[target]
    ok = value <= limit if most else value >= limit
    return f"(target {'≤' if most else '≥'} {limit:g}: {_verdict(ok)})"


DRAIN_NAMES = {
    "relay": "outbox relay",
    "relay_unordered": "outbox relay, --ordering none",
    "relay_transform": "outbox relay, a no-op --transform on every topic",
    "relay_wal": "outbox relay, WAL capture (read from the slot)",
    "relay_no_archive": "outbox relay, --no-archive",
    "relay_wal_no_archive": "outbox relay, WAL capture, --no-archive",
    "ceiling": "minimal loop, plain tables (ceiling)",
    "ceiling_wal": "minimal loop reading the slot, plain archive (WAL ceiling)",
    "bare": "minimal loop on the outbox's tables",
    "seeds": "hand-written loop",
    "txoutbox": "txoutbox, strict ordering",
    "txoutbox_unordered": "txoutbox, strict_ordering=False",
    "faststream_outbox": "faststream-outbox + FastStream's Kafka publisher",
}


def _contender(run: dict[str, Any]) -> str:
    return "minimal loop" if run.get("contender") == "steady_loop" else "relay"


def steady_compared_markdown(compared: list[dict[str, Any]]) -> list[str]:
    """The relay against the minimal loop, per rate: medians over the repeats, and their ratios."""
    if not any("ratio" in row for row in compared):
        return []
    lines = [
        "The relay (table capture) against the minimal loop with archive, commit→ack, medians of "
        "the runs; ms. Ratios are relay / loop (lower is better).",
        "",
        "| rate | relay p50 / p99 | relay WAL p50 / p99 | loop p50 / p99 | ratio p50 / p99 | "
        "CPU relay / loop (core) | CPU ratio |",
        "| ---: | --- | --- | --- | --- | --- | ---: |",
    ]
    for row in compared:
        if "ratio" not in row:
            continue
        relay, loop, ratio = row["relay"], row["loop"], row["ratio"]
        wal = row.get("relay_wal")
        shown_wal = f"{_ms(wal['p50'])} / {_ms(wal['p99'])}" if wal else "-"
        lines.append(
            f"| {row['rate']:,}/s | {_ms(relay['p50'])} / {_ms(relay['p99'])} | {shown_wal} | "
            f"{_ms(loop['p50'])} / {_ms(loop['p99'])} | **{ratio['p50']} / {ratio['p99']}** | "
            f"{_share(relay['cpu_share'])} / {_share(loop['cpu_share'])} | {ratio['cpu_share']} |"
        )
    return [*lines, ""]


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f} %"


def _wakeup(run: dict[str, Any]) -> str:
    """How a steady run's relay learnt of new events: NOTIFY, a 50 ms poll, or the WAL stream."""
    if run.get("capture") == "wal":
        return "WAL capture (streamed)"
    return "NOTIFY" if run["notify"] else "poll 50 ms (no NOTIFY)"


def later_run(name: str, d: dict[str, Any]) -> list[str]:
    """The line that says a scenario comes from a later run than the file's (scripts/merge-drain)."""
    if "run_at" not in d:
        return []
    m = d.get("machine")
    on = f" on {m['cpu_model']}, {m['cores']} cores, PostgreSQL {m['postgresql']}" if m else ""
    return [f"(The {name} from a later run: {d['run_at']}{on}, `{d['command']}`.)", ""]


def drain_markdown(d: dict[str, Any]) -> list[str]:
    lines = later_run("drain", d)
    lines += [
        f"**Drain**: events/s over the middle 80 % of each run (from the moment 10 % of the "
        f"events had been moved to the moment 90 % had, on the parent's monotonic clock, which "
        f"reads each contender's shared counter every 50 ms); median of {d['repeat']} runs, "
        "contenders interleaved, each in a process of its own. Archive on for every contender but "
        "the two `--no-archive` ones. CPU, from the first event moved to the last (start-up "
        "excluded), per 1,000 events moved meanwhile: the contender's process (user + system); "
        "PostgreSQL: all its server processes; broker: the Tansu process when it runs on this "
        "machine (0 for a broker elsewhere).",
        "",
        "| case | contender | events/s (median) | runs | CPU s / 1k ev | PostgreSQL CPU s / 1k ev "
        "| broker CPU s / 1k ev | peak RSS MB |",
        "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for case in d["cases"].values():
        for kind, r in case["contenders"].items():
            runs = ", ".join(f"{x:,.0f}" for x in r["events_per_s_runs"])
            lines.append(
                f"| {case['title']}, {case['events']:,} | {DRAIN_NAMES.get(kind, kind)} | "
                f"{r['events_per_s_median']:,.0f} | {runs} | {r['relay_cpu_s_per_1k']:.3f} | "
                f"{r['postgres_cpu_s_per_1k']:.3f} | {r.get('broker_cpu_s_per_1k', 0.0):.3f} | "
                f"{r['peak_rss_mb']:.0f} |"
            )
    lines.append("")
    for case in d["cases"].values():
        ratio, cpu = case["ratio_relay_to_ceiling"], case["cpu_ratio_relay_to_ceiling"]
        extra = []
        if "ratio_relay_to_bare" in case:
            extra.append(f"relay / loop on the outbox's tables {case['ratio_relay_to_bare']:.2f}")
        if "ratio_ordered_to_unordered" in case:
            extra.append(f"ordered / unordered {case['ratio_ordered_to_unordered']:.2f}")
        if "ratio_transform_to_relay" in case:
            noop = case["ratio_transform_to_relay"]
            extra.append(
                f"a no-op transform: **{noop:.2f}** of the relay's events/s "
                f"{_against(noop, 'transform_vs_relay')}, "
                f"{case['cpu_ratio_transform_to_relay']:.2f} x its CPU per event"
            )
        if "ratio_wal_to_table" in case:
            wal = case["ratio_wal_to_table"]
            extra.append(f"WAL capture / table capture **{wal:.2f}** {_against(wal, 'wal_vs_table')}")
        if "ratio_wal_ceiling_to_table" in case:
            extra.append(
                f"WAL ceiling / table relay {case['ratio_wal_ceiling_to_table']:.2f} (the most any "
                "WAL reader reached here)"
            )
        if "ratio_wal_to_wal_ceiling" in case:
            near = case["ratio_wal_to_wal_ceiling"]
            extra.append(f"WAL relay / WAL ceiling **{near:.2f}** {_against(near, 'wal_vs_wal_ceiling')}")
        if "cpu_ratio_wal_to_table" in case:
            relay_cpu, pg_cpu = case["cpu_ratio_wal_to_table"], case["postgres_cpu_ratio_wal_to_table"]
            extra.append(
                f"CPU per event WAL / table capture: the relay **{relay_cpu:.2f}** "
                f"{_against(relay_cpu, 'wal_relay_cpu_vs_table', most=True)}, PostgreSQL **{pg_cpu:.2f}** "
                f"{_against(pg_cpu, 'wal_postgres_cpu_vs_table', most=True)}"
            )
        if "postgres_cpu_written_and_relayed_wal_to_table" in case:
            wal_w = case["contenders"]["relay_wal"]["write_postgres_cpu_s_per_1k"]
            table_w = case["contenders"]["relay"]["write_postgres_cpu_s_per_1k"]
            extra.append(
                "PostgreSQL's CPU per event written and relayed WAL / table capture "
                f"{case['postgres_cpu_written_and_relayed_wal_to_table']:.2f} (written: {wal_w:.3f} "
                f"against {table_w:.3f} s per 1k events)"
            )
        if "postgres_cpu_ratio_wal_to_table_no_archive" in case:
            extra.append(
                "PostgreSQL's CPU per event WAL / table capture without the archive "
                f"{case['postgres_cpu_ratio_wal_to_table_no_archive']:.2f} (the archive's own share: "
                f"{case['postgres_cpu_archive_wal_per_1k']:.3f} against "
                f"{case['postgres_cpu_archive_table_per_1k']:.3f} s per 1k events)"
            )
        if "ratio_relay_to_seeds" in case:
            seeds = case["ratio_relay_to_seeds"]
            extra.append(f"relay / seeds {seeds:.1f}× {_against(seeds, 'relay_vs_seeds')}")
        rss = case["contenders"]["relay"]["peak_rss_mb"]
        lines.append(
            f"- {case['title']}, {case['events']:,}: relay / ceiling **{ratio:.2f}** "
            f"{_against(ratio, 'relay_vs_ceiling')}; "
            f"CPU per event relay / ceiling **{cpu:.2f}** {_against(cpu, 'cpu_vs_ceiling', most=True)}; "
            f"relay peak RSS {rss:.0f} MB {_against(rss, 'relay_rss_mb', most=True)}"
            + "".join(f"; {e}" for e in extra)
            + "."
        )
        if "peers" in case:
            parts = [
                f"{DRAIN_NAMES[p]}: {DRAIN_NAMES[x['versus']]} / peer {x['ratio']:.1f}×"
                for p, x in case["peers"].items()
            ]
            best = case["peers"][case["best_peer"]]["ratio"]
            lines.append(
                f"- Peers (30 s each by default, same backlog; what each guarantees and skips: "
                f"docs/performance.md): {'; '.join(parts)}. Against the fastest "
                f"({DRAIN_NAMES[case['best_peer']]}): **{best:.1f}×** {_against(best, 'relay_vs_best_peer')}."
            )
    for name, why in d.get("skipped", {}).items():
        lines.append(f"- {DRAIN_NAMES.get(name, name)} skipped: {why}.")
    if "ratio_no_stats_to_analyzed" in d:
        x = d["ratio_no_stats_to_analyzed"]
        lines.append(
            f"- Without statistics / after ANALYZE (relay, realistic events): **{x:.2f}** "
            f"{_against(x, 'no_stats_vs_analyzed')}."
        )
    lines.append("")
    return lines


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"Run {results['started_at']} on {m['cpu_model']}, {m['cores']} cores, "
        f"{m['memory_gib']} GiB; PostgreSQL {m['postgresql']}; broker {m['broker']}; "
        f"Python {m['python']}. Command: `{results['command']}`",
        "",
    ]
    s = results["scenarios"]
    if "drain" in s:
        lines += drain_markdown(s["drain"])
    if "steady" in s:
        lines += later_run("steady scenario", s["steady"])
        lines += [
            f"**Steady** writers commit an order + its event per transaction for "
            f"{s['steady']['seconds_per_rate']:.0f} s per rate; latency in ms.",
            "",
            "| contender | target rate | wake-up | achieved | commit→ack p50 / p95 / p99 / max | "
            "commit→consumer p50 / p99 | CPU (core) | kept up |",
            "| --- | ---: | --- | ---: | --- | --- | ---: | --- |",
        ]
        for r in s["steady"]["runs"]:
            a, c = r["commit_to_ack_ms"], r["commit_to_consumer_ms"]
            cpu = r.get("cpu_share")
            lines.append(
                f"| {_contender(r)} | {r['target_rate']:,}/s | {_wakeup(r)} | "
                f"{r['achieved_write_rate']:,.0f}/s | {_ms(a['p50'])} / {_ms(a['p95'])} / "
                f"{_ms(a['p99'])} / {_ms(a['max'])} | {_ms(c['p50'])} / {_ms(c['p99'])} | "
                f"{'-' if cpu is None else f'{100 * cpu:.0f} %'} | {'yes' if r['kept_up'] else 'no'} |"
            )
        lines.append("")
        lines += steady_compared_markdown(s["steady"].get("compared", []))
    if "writer" in s:
        w = s["writer"]
        lines += [
            f"**Writer** overhead per stack: the business transaction (insert an order, commit) "
            f"with and without `enqueue` of one JSON event, {w['iterations']:,} interleaved pairs "
            "per NOTIFY setting; ms. Targets: overhead p50 <= 0.3, `enqueue_many` of 1,000 <= 20.",
            "",
            "| stack | NOTIFY | without p50 / p99 | with p50 / p99 | overhead p50 "
            "| enqueue_many(1,000) p50 |",
            "| --- | --- | ---: | ---: | ---: | ---: |",
        ]
        for name, r in w["stacks"].items():
            for key in ("notify_on", "notify_off"):
                x = r[key]
                plain, event = x["business_tx_ms"], x["business_tx_with_enqueue_ms"]
                many = _ms(r["enqueue_many_1000_ms"]["p50"]) if key == "notify_on" else ""
                lines.append(
                    f"| {name} | {key.split('_')[1]} | {_ms(plain['p50'])} / {_ms(plain['p99'])} | "
                    f"{_ms(event['p50'])} / {_ms(event['p99'])} | "
                    f"**{x['enqueue_overhead_p50_ms']:.3f}** | {many} |"
                )
        for name, r in w.get("stacks_wal", {}).items():  # WAL capture: a message, no row
            x = r["notify_on"]
            plain, event = x["business_tx_ms"], x["business_tx_with_enqueue_ms"]
            lines.append(
                f"| {name}, WAL capture | – | {_ms(plain['p50'])} / {_ms(plain['p99'])} | "
                f"{_ms(event['p50'])} / {_ms(event['p99'])} | "
                f"**{x['enqueue_overhead_p50_ms']:.3f}** | {_ms(r['enqueue_many_1000_ms']['p50'])} |"
            )
        for name, why in w.get("skipped", {}).items():
            lines.append(f"| {name} | skipped: {why} | | | | |")
        lines.append("")
    if "soak" in s:
        k = s["soak"]
        lines += [
            f"**Soak** {k['minutes']:g} min at {k['rate']:,}/s with a snapshot held "
            f"{k['snapshot_seconds']:g} s: written {k['written']:,}, delivered {k['delivered']:,}; "
            f"events table peak {k['peak_table_bytes'] / 2**20:.1f} MiB, final "
            f"{k['final_table_bytes'] / 2**20:.2f} MiB — "
            f"{'returned near zero' if k['returned_near_zero'] else '**did not return near zero**'}.",
            "",
        ]
    if "snapshot" in s:
        lines += snapshot_markdown(s["snapshot"])
    if "scale" in s:
        lines += [
            "**Scale** relay processes draining one outbox.",
            "",
            "| processes | ordering | events/s | events per CPU-second (relay + PostgreSQL) |",
            "| ---: | --- | ---: | ---: |",
        ]
        for r in s["scale"]["runs"]:
            lines.append(
                f"| {r['processes']} | {r.get('ordering', 'key')} | {r['events_per_s']:,.0f} | "
                f"{r['events_per_cpu_s']:,.0f} |"
            )
        lines.append("")
    if "sinks" in s:
        k = s["sinks"]
        target = TARGETS["relay_vs_sink_loop"]
        lines += [
            "",
            f"**Sinks** drain of {k['events']:,} pending events per sink (JSON, content-type and "
            f"traceparent headers, 1,000 keys), each next to that sink's minimal loop in the same run; "
            f"median of {k['repeat']} runs. Target: relay >= {target} x loop.",
            "",
            "| sink | relay events/s | loop events/s | relay / loop | relay CPU s / 1k | loop CPU s / 1k"
            " | target |",
            "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
        ]
        for scheme, r in k["sinks"].items():
            lines.append(
                f"| {scheme} | {r['relay_events_per_s_median']:,.0f} | "
                f"{r['loop_events_per_s_median']:,.0f} | {r['ratio_relay_to_loop']:.2f} | "
                f"{r['relay_cpu_s_per_1k']:.3f} | "
                f"{r['loop_cpu_s_per_1k']:.3f} | {_verdict(r['ratio_relay_to_loop'] >= target)} |"
            )
    if "console" in s:
        lines += console_markdown(s["console"])
    if "tenants" in s:
        lines += tenants_markdown(s["tenants"])
    if "limits" in s:
        lines += limits_markdown(s["limits"])
    if "verify" in s:
        lines += verifying.markdown(s["verify"])
    return "\n".join(lines)


def limits_markdown(k: dict[str, Any]) -> list[str]:
    """The limits scenario: beside a limited route, a rate across relays, weights."""
    b, a, w = k["beside"], k["across"], k["weights"]
    ratio = b["ratio_median"]
    lines = [
        "",
        f"**Limits** one outbox: {k['fast_events']:,} realistic events to Kafka, and in one run of "
        f"each pair {k['slow_events']:,} more (written first) to a webhook limited to {k['rate']:g}/s. "
        "The Kafka route's drain, events/s over the middle 80 %, without and with the limited backlog "
        f"waiting (target: with / without >= {TARGETS['limits_beside']}):",
        "",
        "| pair | without | with | with / without |",
        "| ---: | ---: | ---: | ---: |",
    ]
    for i, p in enumerate(b["pairs"], 1):
        lines.append(
            f"| {i} | {p['without']:,.0f} | {p['with']:,.0f} | {p['with'] / max(p['without'], 1e-9):.2f} |"
        )
    lines.append(
        f"| median | | | **{'-' if ratio is None else f'{ratio:.2f}'}** "
        f"{'' if ratio is None else _verdict(ratio >= TARGETS['limits_beside'])} |"
    )
    tol = TARGETS["limits_rate_tolerance"]
    lines += [
        "",
        f"**Rate across relays** two relay processes, {a['events']:,} events to a webhook limited to "
        f"{a['limit']:g}/s: {a['requests_per_s']:.1f} requests/s at the receiver over the middle 80 % "
        f"({a['ratio']:.3f} of the limit; target within {tol:.0%}: {_verdict(abs(a['ratio'] - 1) <= tol)}).",
    ]
    if w["ratio"] is not None:
        lines += [
            "",
            f"**Weights** two outboxes of {w['events']:,} events each, one relay, `--weight 'gold*=3'`, "
            f"two sessions: while both had a backlog, {w['gold']:,} events of gold and {w['basic']:,} of "
            f"basic, {w['ratio']:.2f} to 1 (target 3 within 20 %: {_verdict(2.4 <= w['ratio'] <= 3.6)}).",
        ]
    return lines


def snapshot_markdown(k: dict[str, Any]) -> list[str]:
    """The snapshot scenario: each capture mode under a held snapshot, per window, side by side."""
    limit = TARGETS["snapshot_p99_flat"]
    lines = [
        f"**Snapshot**: {k['minutes']:g} min at {k['rate']:,} events/s (an order and its event per "
        "transaction) while another session holds a REPEATABLE READ snapshot open throughout; one "
        "relay to Kafka. Commit -> broker ack of every event (runs over 100,000 events: a sixteenth, by "
        "id); the events table "
        "and the slot sampled throughout. *None held*: the same minutes again with no snapshot "
        "held (the control): how much one minute's p99 varies on this machine anyway; the held "
        "run's worst minute is also given against the control's worst.",
        "",
        "| capture | written | delivered | p99 first window ms | worst later / first | worst / "
        "control's worst | events table first → peak → last MiB | slot WAL kept / not confirmed, "
        "peak MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    mib = 2**20
    for r in k["runs"]:
        first = r["windows"][0]["ack_p99_ms"] if r["windows"] else None
        worst = r["p99_worst_to_first"]
        held = r.get("held", True)
        verdict = (
            "–" if worst is None
            else f"**{worst:.2f}** ({_verdict(worst <= limit)})" if held
            else f"{worst:.2f}"
        )  # fmt: skip
        control = r.get("worst_to_control_worst")
        slot = (
            f"{r['slot_retained_peak_bytes'] / mib:.1f} / {r['slot_unconfirmed_peak_bytes'] / mib:.1f}"
            if r["capture"] == "wal"
            else "–"
        )
        lines.append(
            f"| {_snapshot_run(r)} | {r['written']:,} | {r['delivered']:,} | {_ms(first)} | {verdict} | "
            f"{'–' if control is None else f'{control:.2f}'} | "
            f"{r['table_bytes_first'] / mib:.1f} → {r['table_bytes_peak'] / mib:.1f} → "
            f"{r['table_bytes_last'] / mib:.1f} | {slot} |"
        )
    if k["runs"]:
        lines += ["", "| window from | " + " | ".join(
            f"{_snapshot_run(r)}: delivered/s, ack p50 / p99 ms" for r in k["runs"]) + " |",
            "| ---: | " + " | ".join("---" for _ in k["runs"]) + " |"]  # fmt: skip
        for i, w in enumerate(k["runs"][0]["windows"]):
            cells = []
            for r in k["runs"]:
                x = r["windows"][i] if i < len(r["windows"]) else None
                cells.append(
                    "–" if x is None
                    else f"{x['delivered_per_s']:,.0f}, {_ms(x['ack_p50_ms'])} / {_ms(x['ack_p99_ms'])}"
                )  # fmt: skip
            lines.append(f"| {w['from_s']:g} s | " + " | ".join(cells) + " |")
    if "skipped" in k:
        lines.append(f"- WAL capture skipped: {k['skipped']}.")
    lines.append("")
    return lines


def _snapshot_run(r: dict[str, Any], kind: str = "") -> str:
    """A snapshot run's name: its capture mode (then ``kind``), and whether it is the control
    (none held; reports from before the control have no ``held``: held runs)."""
    return f"{r['capture']}{kind}" + ("" if r.get("held", True) else ", none held")


def _cell(value: float | None, fmt: str, meets: Callable[[float], bool] | None = None, unit: str = "") -> str:
    """A table cell: ``value`` formatted, with its verdict when ``meets`` judges it; "-" when not
    measured."""
    if value is None:
        return "-"
    return f"{value:{fmt}}{unit}" + (f" {_verdict(meets(value))}" if meets is not None else "")


def tenants_markdown(t: dict[str, Any]) -> list[str]:
    target = TARGETS["tenants_ratio"]
    cpu, tx = TARGETS["tenants_idle_cpu_percent"], TARGETS["tenants_idle_tx_per_outbox"]
    lines = [
        "",
        f"**Tenants** one relay process over many outboxes (schemas) of one database: "
        f"{t['events']:,} realistic events spread evenly over them; events/s over the middle 80 % "
        "of the drain (the relay's first look at every outbox: its sessions read each outbox's tables "
        "and plan its statements for the first time), and of the same backlog again committed at once "
        "and drained by the same relay (warm, as a relay that has run a while), and the ratio to one "
        f"outbox (target at {' and '.join(f'{n:,}' for n in RATIO_AT)} "
        f"outboxes: >= {target}); then the idle relay's cost (once the drain's tables are vacuumed and "
        "analyzed, autovacuum's work done): the database's transactions per second, "
        f"per outbox (target at {IDLE_AT:,}: <= {tx}), the relay's CPU (target at {IDLE_AT:,}: <= {cpu:g} % "
        "of a core), and its peak RSS per outbox beyond the first.",
        "",
        "| outboxes | events/s | / one outbox | warm events/s | / one outbox | idle transactions/s "
        "| per outbox | idle relay CPU | peak RSS MB | RSS MB per outbox |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in t["runs"]:
        ratio, warm = r["ratio_to_one"], r.get("warm_ratio_to_one")
        judged = r["outboxes"] in RATIO_AT
        at = r["outboxes"] == IDLE_AT
        per_outbox, idle_cpu = r["idle_transactions_per_s_per_outbox"], r.get("idle_cpu_percent")
        cells = [
            f"{r['outboxes']:,}",
            _cell(r["events_per_s"], ",.0f"),
            _cell(ratio, ".2f", (lambda v: v >= target) if judged else None),
            _cell(r.get("warm_events_per_s"), ",.0f"),
            _cell(warm, ".2f", (lambda v: v >= target) if judged else None),
            _cell(r["idle_transactions_per_s"], ",.1f"),
            _cell(per_outbox, ".3f", (lambda v: v <= tx) if at else None),
            _cell(idle_cpu, ".1f", (lambda v: v <= cpu) if at else None, " %"),
            f"{r['peak_rss_mb']:.0f}",
            _cell(r["rss_mb_per_outbox"], ".3f"),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    stopped = [r for r in t["runs"] if r.get("stopped")]
    if stopped:
        lines += [""] + [
            f"- {r['outboxes']:,} outboxes: stopped, {r['stopped']}; what it did not reach is not "
            "measured (-)."
            for r in stopped
        ]
    pages = [r for r in t["runs"] if r.get("fleet_page_ms")]
    if pages:
        limit = TARGETS["console_page_p95_ms"]
        lines += ["", "**The console's fleet page** over those outboxes (one row each), 20 requests:", ""]
        lines += [
            f"- {r['outboxes']:,} outboxes: the first request {r['fleet_page_ms'].get('first', 0):.0f} ms "
            f"(it prepares each outbox's statement), then p50 {r['fleet_page_ms']['p50']:.0f} ms, p95 "
            f"{r['fleet_page_ms']['p95']:.0f} ms (target p95 <= {limit:g} ms: "
            f"{_verdict(r['fleet_page_ms']['p95'] <= limit)})"
            for r in pages
        ]
    f = t["fairness"]
    q = f["quiet_latency_ms"]
    acked = f.get("quiet_acked", f["quiet_events"])
    goal = f"target p99 <= {TARGETS['tenants_quiet_p99_ms']:g} ms"
    if acked < FAIRNESS_SAMPLES:  # a p99 of a few events says nothing either way
        verdict = (
            f"{goal}: not judged, {acked} events acked where a p99 needs {FAIRNESS_SAMPLES}; "
            "a larger --tenants-busy drains longer"
        )
    else:
        verdict = f"{goal}: {_verdict(q['p99'] is not None and q['p99'] <= TARGETS['tenants_quiet_p99_ms'])}"
    lines += [
        "",
        f"**Fairness** a busy outbox draining {f['busy_events']:,} events ({f['busy_events_per_s']:,.0f} "
        f"events/s) while a quiet one is written at {f['quiet_rate']} events/s: the quiet one's commit -> "
        f"ack latency over {f['quiet_events']} events, p50 {_ms(q['p50'])} ms, p99 {_ms(q['p99'])} ms, "
        f"max {_ms(q['max'])} ms ({verdict}).",
        "",
    ]
    return lines


def console_markdown(c: dict[str, Any]) -> list[str]:
    z = c["sizes"]
    target = TARGETS["console_page_p95_ms"]
    lines = [
        "",
        f"**Console** pages of `outbox console` at {z['pending']:,} pending, {z['dead_letters']:,} dead "
        f"letters and {z['archived']:,} archived events (over {c['days']} days; "
        f"{z['bytes'] / 2**20:,.0f} MiB with indexes), {c['requests']} requests each over one "
        f"keep-alive connection; ms to the last byte. Target: p95 <= {target:g} ms.",
        "",
        "| page | request | p50 | p95 | target |",
        "| --- | --- | ---: | ---: | --- |",
    ]
    for name, r in c["pages"].items():
        lines.append(
            f"| {name} | `{r['request'][:60]}` | {_ms(r['p50_ms'])} | {_ms(r['p95_ms'])} | "
            f"{_verdict((r['p95_ms'] or 0) <= target) if r.get('target', True) else 'not a target'} |"
        )
    return [*lines, ""]


def _rate_curve(
    series: list[list[float]] | list[tuple[float, int]],
) -> tuple[list[float], list[float]]:
    ts, rates = [], []
    window = 1.0
    j = 0
    for i in range(1, len(series)):
        t1, n1 = series[i]
        while j < i and t1 - series[j][0] > window:
            j += 1
        t0, n0 = series[max(0, j - 1)] if j else series[0]
        if t1 > t0:
            ts.append(t1)
            rates.append((n1 - n0) / (t1 - t0))
    return ts, rates


def _steady_plot(runs: list[dict[str, Any]], out: Path, plt: Any) -> str:
    """One panel per write rate, each run's distribution; a contender's repeats share a colour."""
    runs = [r for r in runs if r["latency_samples_ms"]]
    rates = sorted({r["target_rate"] for r in runs}) or [0]
    fig, axes = plt.subplots(1, len(rates), figsize=(4.2 * len(rates), 4.6), sharey=True, squeeze=False)
    handles: dict[str, Any] = {}
    for ax, rate in zip(axes[0], rates, strict=True):
        for r in runs:
            if r["target_rate"] != rate:
                continue
            how = "WAL capture" if r.get("capture") == "wal" else f"NOTIFY {'on' if r['notify'] else 'off'}"
            label = f"{_contender(r)}, {how}"
            colour = f"C{list(handles).index(label) if label in handles else len(handles)}"
            xs = r["latency_samples_ms"]
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            (handles[label],) = ax.plot(xs, ys, color=colour, lw=1.2, alpha=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("commit → broker ack, ms (log)")
        ax.set_title(f"{rate:,} events/s")
        ax.axvline(10, color="grey", ls=":", lw=1)
        ax.axvline(50, color="grey", ls="--", lw=1)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("share of events")
    fig.suptitle("Latency distribution per write rate (each run; a contender's repeats in one colour)")
    fig.legend(
        list(handles.values()), list(handles), loc="lower center", ncol=min(4, len(handles)), frameon=False
    )
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(out / "steady_latency.png", dpi=110)
    plt.close(fig)
    return "steady_latency.png"


def plots(results: dict[str, Any], out: Path) -> list[str]:
    """Draw the PNGs; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made: list[str] = []
    s = results["scenarios"]
    if "drain" in s:
        cases = s["drain"]["cases"]
        # Two panels a row, and one legend for all of them under the panels, at a size a page
        # shows legibly (four panels in a row, each with its own legend in 6 pt, could not be read).
        columns = min(2, len(cases))
        grid_rows = -(-len(cases) // columns)
        fig, axes = plt.subplots(grid_rows, columns, figsize=(6.5 * columns, 4.2 * grid_rows), squeeze=False)
        colours = {kind: f"C{i}" for i, kind in enumerate(DRAIN_NAMES)}  # one colour per contender
        handles: dict[str, Any] = {}
        for ax, case in zip(axes.flat, cases.values(), strict=False):
            for kind, r in case["contenders"].items():
                ts, rates = _rate_curve(r["series"])
                name = DRAIN_NAMES.get(kind, kind)
                (handles[name],) = ax.plot(ts, rates, label=name, color=colours.get(kind))
            ax.set_xlabel("seconds")
            ax.set_ylabel("events/s (1 s window)")
            ax.set_title(f"{case['title']}, {case['events']:,}", fontsize=11)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[len(cases) :]:
            ax.set_visible(False)
        fig.legend(
            list(handles.values()), list(handles), loc="lower center", ncol=2, fontsize=10, frameon=False
        )
        fig.tight_layout(rect=(0, 0.04 + 0.035 * (-(-len(handles) // 2)) / grid_rows, 1, 1))
        fig.savefig(out / "drain_throughput.png", dpi=110)
        plt.close(fig)
        made.append("drain_throughput.png")
    if "steady" in s:
        made.append(_steady_plot(s["steady"]["runs"], out, plt))
    if "soak" in s and s["soak"]["samples"]:
        k = s["soak"]
        t = [x["t"] for x in k["samples"]]
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
        a1.plot(t, [x["table_bytes"] / 2**20 for x in k["samples"]], label="events table MiB")
        a1b = a1.twinx()
        a1b.plot(t, [x["dead_tuples"] for x in k["samples"]], color="tab:red", label="dead tuples")
        a1.set_ylabel("MiB")
        a1b.set_ylabel("dead tuples")
        a1.set_title("Soak: hot table size and dead tuples")
        ts, rates = _rate_curve(k["series_relay"])
        a2.plot(ts, rates, label="delivered events/s")
        a2.set_xlabel("seconds")
        a2.set_ylabel("events/s")
        lo, hi = k["snapshot_window_s"]
        if lo is not None and hi is not None:
            for ax in (a1, a2):
                ax.axvspan(lo, hi, color="orange", alpha=0.2, label="snapshot held")
        a1.legend(loc="upper left")
        a1b.legend(loc="upper right")
        a2.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(out / "soak.png", dpi=110)
        plt.close(fig)
        made.append("soak.png")
    if "snapshot" in s and s["snapshot"]["runs"]:
        k = s["snapshot"]
        fig, (a1, a2, a3) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
        for r in k["runs"]:
            label = _snapshot_run(r, " capture")
            xs = [w["from_s"] + r["window_s"] / 2 for w in r["windows"]]
            a1.plot(xs, [w["ack_p99_ms"] for w in r["windows"]], marker="o", label=f"{label}, p99")
            a1.plot(xs, [w["ack_p50_ms"] for w in r["windows"]], ls=":", label=f"{label}, p50")
            t = [x["t"] for x in r["samples"]]
            a2.plot(t, [x["table_bytes"] / 2**20 for x in r["samples"]], label=f"{label}: events table")
            if r["capture"] == "wal" and r.get("held", True):
                a2.plot(t, [x["slot_unconfirmed_bytes"] / 2**20 for x in r["samples"]], ls="--",
                        label="WAL capture: WAL not confirmed")  # fmt: skip
            ts, rates = _rate_curve(r["series"])
            a3.plot(ts, rates, label=label)
        a1.set_ylabel("commit → ack, ms")
        a1.set_title(f"Writes at {k['rate']:,}/s under a held snapshot")
        a2.set_ylabel("MiB")
        a3.set_ylabel("delivered events/s")
        a3.set_xlabel("seconds since the writers started")
        for ax in (a1, a2, a3):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / "snapshot.png", dpi=110)
        plt.close(fig)
        made.append("snapshot.png")
    if "scale" in s:
        runs = s["scale"]["runs"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
        modes = sorted({r.get("ordering", "key") for r in runs})
        procs = sorted({r["processes"] for r in runs})
        width = 0.8 / len(modes)
        for i, mode in enumerate(modes):
            xs = [procs.index(r["processes"]) + i * width for r in runs if r.get("ordering", "key") == mode]
            sel = [r for r in runs if r.get("ordering", "key") == mode]
            a1.bar(xs, [r["events_per_s"] for r in sel], width, label=f"ordering {mode}")
            a2.bar(xs, [r["events_per_cpu_s"] for r in sel], width, label=f"ordering {mode}")
        for ax in (a1, a2):
            ax.set_xticks([p + 0.4 - width / 2 for p in range(len(procs))], [str(p) for p in procs])
            ax.legend()
        a1.set_title("events/s")
        a2.set_title("events per CPU-second")
        for ax in (a1, a2):
            ax.set_xlabel("relay processes")
        fig.tight_layout()
        fig.savefig(out / "scale.png", dpi=110)
        plt.close(fig)
        made.append("scale.png")
    if "sinks" in s and s["sinks"]["sinks"]:
        k = s["sinks"]["sinks"]
        names = list(k)
        fig, ax = plt.subplots(figsize=(8, 4.5))
        xs = list(range(len(names)))
        ax.bar([x - 0.2 for x in xs], [k[n]["relay_events_per_s_median"] for n in names], 0.4, label="relay")
        ax.bar(
            [x + 0.2 for x in xs],
            [k[n]["loop_events_per_s_median"] for n in names],
            0.4,
            label="minimal loop",
        )
        for x, n in zip(xs, names, strict=True):
            ax.annotate(f"{k[n]['ratio_relay_to_loop']:.2f}x", (x - 0.2, k[n]["relay_events_per_s_median"]),
                        ha="center", va="bottom")  # fmt: skip
        ax.set_xticks(list(xs), names)
        ax.set_ylabel("events/s (median)")
        ax.set_title("Drain per sink: relay vs that sink's minimal loop, same run")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(out / "sinks.png", dpi=110)
        plt.close(fig)
        made.append("sinks.png")
    if "console" in s:
        pages = s["console"]["pages"]
        names = list(pages)
        fig, ax = plt.subplots(figsize=(9, 5))
        rows = range(len(names))
        ax.barh([y - 0.2 for y in rows], [pages[n]["p50_ms"] for n in names], 0.4, label="p50")
        ax.barh([y + 0.2 for y in rows], [pages[n]["p95_ms"] for n in names], 0.4, label="p95")
        ax.axvline(TARGETS["console_page_p95_ms"], color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_yticks(list(rows), names)
        ax.invert_yaxis()
        ax.set_xlabel("ms to the last byte")
        z = s["console"]["sizes"]
        ax.set_title(
            f"Console pages at {z['pending']:,} pending, {z['dead_letters']:,} dead, "
            f"{z['archived']:,} archived"
        )
        ax.legend()
        ax.grid(alpha=0.3, axis="x")
        fig.tight_layout()
        fig.savefig(out / "console.png", dpi=110)
        plt.close(fig)
        made.append("console.png")
    if "tenants" in s and s["tenants"]["runs"]:
        runs = s["tenants"]["runs"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 4))
        at = list(range(len(runs)))
        labels = [f"{r['outboxes']:,}" for r in runs]
        a1.bar(at, [_or_nan(r["events_per_s"]) for r in runs])  # not measured: no bar
        a1.set_title("drain events/s, one relay")
        a1.set_xlabel("outboxes the backlog is spread over")
        a2.bar(at, [_or_nan(r["idle_transactions_per_s"]) for r in runs])
        a2.set_title("idle: database transactions/s")
        a2.set_xlabel("outboxes")
        for ax in (a1, a2):
            ax.set_xticks(at, labels)
        fig.tight_layout()
        fig.savefig(out / "tenants.png", dpi=110)
        plt.close(fig)
        made.append("tenants.png")
    if "limits" in s:
        k = s["limits"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        pairs = k["beside"]["pairs"]
        at = list(range(len(pairs)))
        a1.bar([x - 0.2 for x in at], [p["without"] for p in pairs], 0.4, label="without")
        a1.bar([x + 0.2 for x in at], [p["with"] for p in pairs], 0.4, label="with the limited backlog")
        a1.set_xticks(at, [str(x + 1) for x in at])
        a1.set_xlabel("pair")
        a1.set_title("Kafka route's drain, events/s")
        a1.legend()
        per = k["across"]["per_second"]
        a2.plot(range(len(per)), per, marker="o")
        a2.axhline(k["across"]["limit"], color="grey", linestyle="--", label="the limit")
        a2.set_title("requests/s at the webhook, two relays")
        a2.set_xlabel("second")
        a2.legend()
        fig.tight_layout()
        fig.savefig(out / "limits.png", dpi=110)
        plt.close(fig)
        made.append("limits.png")
    if "writer" in s and s["writer"].get("stacks"):
        w = s["writer"]["stacks"]
        names = list(w)
        fig, ax = plt.subplots(figsize=(9, 4.5))
        xs = list(range(len(names)))
        for offset, key, label in ((-0.2, "notify_on", "NOTIFY on"), (0.2, "notify_off", "NOTIFY off")):
            ax.bar([x + offset for x in xs], [w[n][key]["enqueue_overhead_p50_ms"] for n in names], 0.4,
                   label=label)  # fmt: skip
        ax.axhline(0.3, color="grey", linestyle="--", linewidth=1, label="target 0.3 ms")
        ax.set_xticks(list(xs), names, rotation=15)
        ax.set_ylabel("enqueue overhead, p50 (ms)")
        ax.set_title("What enqueue adds to a business transaction, per stack")
        ax.legend()
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(out / "writer.png", dpi=110)
        plt.close(fig)
        made.append("writer.png")
    if "verify" in s:
        fig, ax = plt.subplots(figsize=(6, 4))
        verifying.plot(s["verify"], ax)
        fig.tight_layout()
        fig.savefig(out / "verify.png", dpi=110)
        plt.close(fig)
        made.append("verify.png")
    return made


def write(results: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    results["plots"] = plots(results, out)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    table = markdown(results)
    (out / "results.md").write_text(table + "\n" + "".join(f"\n![{p}]({p})\n" for p in results["plots"]))


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value
