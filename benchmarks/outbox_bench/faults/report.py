"""The fault suite's table: one row per scenario, with notes on what happened."""

from __future__ import annotations

from typing import Any

# Why producers were replaced (counted from the relays' logs): fenced by the broker, a message
# past its deadline, or stuck.
REPLACED_BECAUSE = (
    ("producers_lost", "fenced"),
    ("producers_past_deadline", "past its deadline"),
    ("producers_stuck", "stuck"),
)


def _fmt_recover(v: float | None) -> str:
    return "—" if v is None else f"{v:.1f} s"


def _note(name: str, r: dict[str, Any]) -> str:
    parts = []
    if "kills" in r:
        parts.append(f"{r['kills']} SIGKILLs")
    if "terminated" in r:
        parts.append(
            f"{r['terminated']} sessions terminated "
            f"({r.get('terminated_mid_transaction', 0)} mid-transaction)"
        )
    if name == "snapshot":
        parts.append(
            f"{r['rate_before']:.0f}/{r['rate_during']:.0f}/{r['rate_after']:.0f} ev/s before/during/after; "
            f"table {r['table_before_mib']} → {r['table_held_peak_mib']} → {r['table_end_mib']} MiB"
        )
    if name == "poison":
        parts.append(f"{r['poison']} poison, all dead at attempt 1: {r['poison_retried'] == 0}")
    if name == "soak":
        parts.append(
            f"table peak {r['table_peak_mib']} MiB, end {r['table_end_mib']} MiB (heap {r['heap_end_mib']})"
        )
    if name.startswith("blackhole"):
        drained = _fmt_recover(r.get("drained_seconds"))
        parts.append(
            f"/readyz 503 after {_fmt_recover(r.get('not_ready_seconds'))} (every relay), /livez 200 "
            f"throughout: {r.get('livez_200_throughout')}; backlog < 100 {drained} after healing"
        )
    if r.get("stale_acks_refused"):
        parts.append(f"{r['stale_acks_refused']} stale acks refused")
    if r.get("producers_recreated"):
        why = ", ".join(f"{r[k]} {w}" for k, w in REPLACED_BECAUSE if r.get(k))
        parts.append(f"{r['producers_recreated']} producers recreated" + (f" ({why})" if why else ""))
    if r.get("drain_target_seconds") is not None:
        parts.append(f"drain target {r['drain_target_seconds']:.0f} s")
    if r.get("consumer_gaps"):
        parts.append(
            f"the live consumer's fetch skipped {r['consumer_gaps']} offsets, read again from the broker "
            "by a re-read of the topic (recover includes the wait for it)"
        )
    if r.get("unsure_commits"):
        parts.append(f"{r['unsure_commits']} commits cut off ({r['unsure_committed']} had committed)")
    if r.get("double_archived"):
        parts.append(f"{r['double_archived']} ARCHIVED TWICE")
    if r.get("unexpected_dead"):
        parts.append(f"{r['unexpected_dead']} UNEXPECTED DEAD LETTERS")
    if not r.get("drained"):
        parts.append("DID NOT DRAIN")
    if r.get("short_windows"):
        parts.append("TOO FEW COMMITS: " + ", ".join(r["short_windows"]))
    elif not r.get("provoked", True):
        parts.append("THE FAULT DID NOT HAPPEN")
    return "; ".join(parts)


def markdown(results: dict[str, Any]) -> str:
    m = results["machine"]
    lines = [
        f"Fault suite ({'short' if results['short'] else 'full'}"
        f"{', WAL capture' if results.get('capture') == 'wal' else ''}), {results['started_at']}, "
        f"{m.get('cpu_model', '?')}, {m.get('cores', '?')} cores, "
        f"PostgreSQL {m.get('postgresql', '?')}, {m.get('broker', '?')}",
        "",
        "| scenario | committed | delivered | archived | dead | duplicates | lost | order violations "
        "| recover | result | notes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, r in results["scenarios"].items():
        lines.append(
            f"| {name} | {r['committed']:,} | {r['delivered']:,} | {r['archived']:,} "
            f"| {r['dead_lettered']:,} | {r['duplicates']:,} | {r['lost']:,} | {r['order_violations']:,} "
            f"| {_fmt_recover(r['recover_seconds'])} "
            f"| {'pass' if r['passed'] else '**FAIL**'} | {_note(name, r)} |"
        )
    return "\n".join(lines) + "\n"
