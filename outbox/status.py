"""``outbox status``: the operational queries as one report."""

from __future__ import annotations

from typing import Any

import psycopg

from outbox.queries import query


def collect(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """Depth, age, retries, dead letters and recent throughput of the outbox in ``schema``."""
    row = conn.execute(query("status_counts", schema)).fetchone()
    assert row is not None
    pending, retrying, dead, delivered, oldest = row
    by_topic = conn.execute(query("status_by_topic", schema)).fetchall()
    errors = conn.execute(query("status_errors", schema)).fetchall()
    last_hour = conn.execute(query("status_delivered_last_hour", schema)).fetchone()
    return {
        "schema": schema,
        "pending": int(pending),
        "retrying": int(retrying),
        "dead": int(dead),
        "delivered": int(delivered),
        "delivered_last_hour": int(last_hour[0]) if last_hour else 0,
        "oldest_pending_age_seconds": None if oldest is None else round(float(oldest), 3),
        "pending_by_topic": [
            {"topic": t, "pending": int(n), "oldest_age_seconds": round(float(a), 3)} for t, n, a in by_topic
        ],
        "top_errors": [{"error": e, "events": int(n)} for e, n in errors],
    }


def render(report: dict[str, Any]) -> str:
    """A human-readable table of ``collect``'s report."""
    age = report["oldest_pending_age_seconds"]
    lines = [
        f"outbox status (schema {report['schema']})",
        f"  pending              {report['pending']}",
        f"  retrying             {report['retrying']}",
        f"  oldest pending age   {'-' if age is None else f'{age:.1f} s'}",
        f"  dead letters         {report['dead']}",
        f"  delivered (archive)  {report['delivered']}",
        f"  delivered last hour  {report['delivered_last_hour']}",
    ]
    if report["pending_by_topic"]:
        lines.append("")
        lines.append(f"  {'topic':<40} {'pending':>10} {'oldest (s)':>12}")
        for t in report["pending_by_topic"]:
            lines.append(f"  {t['topic']:<40} {t['pending']:>10} {t['oldest_age_seconds']:>12.1f}")
    if report["top_errors"]:
        lines.append("")
        lines.append("  errors of events awaiting retry:")
        for e in report["top_errors"]:
            lines.append(f"  {e['events']:>8}  {e['error'][:100]}")
    return "\n".join(lines)
