"""``outbox status``: the operational queries as one report."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg

from outbox import capture
from outbox.escape import escape
from outbox.events import key_text
from outbox.store.queries import query

if TYPE_CHECKING:
    from outbox.sinks.claim_check import Store


def collect(conn: psycopg.Connection[Any], schema: str, store: Store | None = None) -> dict[str, Any]:
    """Depth, age, retries, dead letters and recent throughput of the outbox in ``schema``; the
    payloads the claim-check ``store`` holds (default: the ``postgres:`` store's table)."""
    row = conn.execute(query("status_counts", schema)).fetchone()
    assert row is not None
    pending, retrying, dead, expired, delivered, oldest = row
    by_topic = conn.execute(query("status_by_topic", schema)).fetchall()
    errors = conn.execute(query("status_errors", schema)).fetchall()
    last_hour = conn.execute(query("status_delivered_last_hour", schema)).fetchone()
    parked = conn.execute(query("status_parked_keys", schema)).fetchall()
    if store is None:
        held = conn.execute(query("claim_check_held", schema)).fetchone() or (0, 0)
        store_name = f"postgres:{schema}"
    else:
        held, store_name = store.held(), store.name
    return {
        "schema": schema,
        "pending": int(pending),
        "retrying": int(retrying),
        "dead": int(dead),
        "expired": int(expired),  # of the dead letters: claimed at or after their expires_at
        "delivered": int(delivered),
        "delivered_last_hour": int(last_hour[0]) - int(last_hour[1]) if last_hour else 0,
        "filtered_last_hour": int(last_hour[1]) if last_hour else 0,
        "oldest_pending_age_seconds": None if oldest is None else round(float(oldest), 3),
        "pending_by_topic": [
            {"topic": t, "pending": int(n), "oldest_age_seconds": round(float(a), 3)} for t, n, a in by_topic
        ],
        "top_errors": [{"error": e, "events": int(n)} for e, n in errors],
        "parked_keys": [
            {"key": key_text(k), "topic": t, "dead_letter_id": int(i), "error": err, "waiting": int(w)}
            for k, t, i, err, w in parked
        ],
        **fleet(conn, schema),
        "limits": limits(conn, schema),
        "table": health(conn, schema),
        "claim_checks": {"store": store_name, "payloads": int(held[0]), "bytes": int(held[1])},
        "capture": capture_status(conn, schema),
    }


def capture_status(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """How events are captured; in WAL capture (or with a slot kept), the slot: streamed by a
    relay or not, and the WAL it keeps that is not confirmed yet."""
    found = capture.state(conn, schema)
    out: dict[str, Any] = {"mode": found.mode, "slot": found.slot}
    if found.slot is not None:
        row = conn.execute(query("slot_lag", schema), {"slot": found.slot}).fetchone()
        out["slot_exists"] = row is not None
        out["slot_active"] = bool(row and row[0])
        out["slot_lag_bytes"] = int(row[1] or 0) if row else None
        out["handed_on_lsn"] = found.lsn
    return out


SUMMARY_FIELDS = (
    "pending",
    "retrying",
    "dead",
    "parked_keys",
    "oldest_pending_age_seconds",
    "delivered_last_hour",
    "relays",
    "unowned_partitions",
)


def summary(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """One outbox's numbers for ``outbox status --all`` (no count of the archive: it is big)."""
    row = conn.execute(query("status_summary", schema)).fetchone()
    assert row is not None
    out: dict[str, Any] = dict(zip(SUMMARY_FIELDS, row, strict=True))
    age = out["oldest_pending_age_seconds"]
    out["oldest_pending_age_seconds"] = None if age is None else round(float(age), 3)
    return out


def render_summaries(rows: list[dict[str, Any]]) -> str:
    """``outbox status --all``: one line per outbox, then the totals."""
    head = (
        f"{'outbox':<28} {'pending':>9} {'retrying':>9} {'dead':>7} {'parked':>7} {'oldest':>9} "
        f"{'last hour':>10} {'relays':>6}  state"
    )
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(
                f"{r['name']:<28} {'':>9} {'':>9} {'':>7} {'':>7} {'':>9} {'':>10} {'':>6}  {r['error']}"
            )
            continue
        age = r["oldest_pending_age_seconds"]
        oldest = "-" if age is None else f"{age:.1f} s"
        state = "no live relay" if r["pending"] and not r["relays"] else "ok"
        lines.append(
            f"{r['name']:<28} {r['pending']:>9} {r['retrying']:>9} {r['dead']:>7} {r['parked_keys']:>7} "
            f"{oldest:>9} {r['delivered_last_hour']:>10} {r['relays']:>6}  {state}"
        )
    ok = [r for r in rows if "error" not in r]
    lines.append(
        f"{len(rows)} outboxes, {len(rows) - len(ok)} unreadable; "
        f"{sum(r['pending'] for r in ok)} pending, {sum(r['dead'] for r in ok)} dead letters"
    )
    return "\n".join(lines)


def _capture_line(c: dict[str, Any]) -> str:
    if c["slot"] is None:
        return str(c["mode"])
    if not c["slot_exists"]:
        return f"{c['mode']}, slot {c['slot']} MISSING (events written to the WAL since it went are lost)"
    reader = "read by a relay" if c["slot_active"] else "NOT read by any relay"
    return (
        f"{c['mode']}, slot {c['slot']} {reader}, {c['slot_lag_bytes'] / 2**20:.1f} MiB of WAL not confirmed"
    )


def fleet(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """The live relays (partitions, heartbeat, readiness) and the partitions none owns."""
    owners = conn.execute(query("status_owners", schema)).fetchall()
    unowned = conn.execute(query("status_unowned", schema)).fetchone()
    return {
        "relays": [
            {
                "id": rid,
                "name": name,
                "ordering": ordering,
                "heartbeat_at": hb.isoformat(),
                "partitions": list(parts),
                "readiness": readiness,
            }
            for rid, name, ordering, hb, parts, readiness in owners
        ],
        "unowned_partitions": int(unowned[0]) if unowned else 0,
    }


def limits(conn: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
    """The limits (--limit) the outbox's relays apply: each one's backlog (events waiting of the
    topics it matches), its events in flight, and how long ago a relay last took its tokens."""
    rows = conn.execute(query("status_limits", schema), {"schema": schema}).fetchall()
    return [
        {
            "limit": f"{glob}={spec}",
            "waiting": int(waiting),
            "in_flight": int(in_flight),
            "last_taken_seconds_ago": round(float(since), 1),
        }
        for glob, spec, waiting, in_flight, since in rows
    ]


def health(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """The events table's dead and live tuples and bytes, and the oldest snapshot's age."""
    row = conn.execute(query("hot_table_stats", schema), {"schema": schema}).fetchone()
    xmin = conn.execute(query("oldest_xmin_age", schema)).fetchone()
    return {
        "dead_tuples": int(row[0]) if row else 0,
        "live_tuples": int(row[1]) if row else 0,
        "bytes": int(row[2]) if row else 0,
        "oldest_xmin_age_seconds": (round(float(xmin[0]), 1) if xmin and xmin[0] is not None else None),
    }


def _ranges(parts: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []  # [first, last] of each run of consecutive partitions
    for p in sorted(parts):
        if runs and runs[-1][1] == p - 1:
            runs[-1][1] = p
        else:
            runs.append([p, p])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def render(report: dict[str, Any]) -> str:
    """A human-readable table of ``collect``'s report."""
    age = report["oldest_pending_age_seconds"]
    lines = [
        f"outbox status (schema {report['schema']})",
        f"  pending              {report['pending']}",
        f"  retrying             {report['retrying']}",
        f"  oldest pending age   {'-' if age is None else f'{age:.1f} s'}",
        f"  dead letters         {report['dead']}"
        + (f" ({report['expired']} expired)" if report["expired"] else ""),
        f"  delivered (archive)  {report['delivered']}",
        f"  delivered last hour  {report['delivered_last_hour']}"
        + (f" (and {report['filtered_last_hour']} filtered)" if report["filtered_last_hour"] else ""),
        f"  hot table            {report['table']['bytes'] / 2**20:.1f} MiB, "
        f"{report['table']['dead_tuples']} dead tuples",
        "  oldest snapshot      "
        + (
            "-"
            if report["table"]["oldest_xmin_age_seconds"] is None
            else f"{report['table']['oldest_xmin_age_seconds']:.0f} s (it holds back vacuum)"
        ),
        f"  claim-check store    {report['claim_checks']['payloads']} payloads, "
        f"{report['claim_checks']['bytes'] / 2**20:.1f} MiB ({report['claim_checks']['store']})",
        f"  capture              {_capture_line(report['capture'])}",
    ]
    if report["pending_by_topic"]:
        lines.append("")
        lines.append(f"  {'topic':<40} {'pending':>10} {'oldest (s)':>12}")
        for t in report["pending_by_topic"]:
            lines.append(f"  {escape(t['topic']):<40} {t['pending']:>10} {t['oldest_age_seconds']:>12.1f}")
    if report["limits"]:
        lines.append("")
        lines.append(f"  {'limit (--limit)':<40} {'waiting':>10} {'in flight':>10} {'tokens taken':>14}")
        for lim in report["limits"]:
            taken = f"{lim['last_taken_seconds_ago']:.0f} s ago"
            lines.append(f"  {lim['limit']:<40} {lim['waiting']:>10} {lim['in_flight']:>10} {taken:>14}")
    if report["top_errors"]:
        lines.append("")
        lines.append("  errors of events awaiting retry:")
        for e in report["top_errors"]:
            lines.append(f"  {e['events']:>8}  {escape(e['error'])[:100]}")
    if report["parked_keys"]:
        lines.append("")
        lines.append("  parked keys (redrive or skip with `outbox dead`):")
        for k in report["parked_keys"]:
            lines.append(
                f"  key {escape(str(k['key'])):<24} topic {escape(k['topic']):<20} "
                f"dead letter {k['dead_letter_id']}  {k['waiting']} events waiting"
            )
    lines.append("")
    lines.append(
        f"  relays ({len(report['relays'])} live, {report['unowned_partitions']} partitions unowned):"
    )
    for r in report["relays"]:
        lines.append(
            f"  {escape(r['name']):<28} {r['ordering']:<5} {escape(r['readiness'] or '-'):<20} "
            f"{len(r['partitions']):>3} partitions {_ranges(r['partitions'])}"
        )
    return "\n".join(lines)
