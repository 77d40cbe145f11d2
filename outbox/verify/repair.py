"""What a verification found missing, queued again: each under its own event id (a consumer's
inbox drops a copy that did arrive), through the same routes and transforms, in order per key,
recorded in the audit trail."""

from __future__ import annotations

from typing import Any

import psycopg

from outbox.operate import audit
from outbox.store.queries import int_array, query
from outbox.verify.run import Report

CHUNK = 1000


def repair(
    conn: psycopg.Connection[Any], schema: str, report: Report, *, topics: str | None = None,
    via: str = "cli", actor: str | None = None,
) -> int:  # fmt: skip
    """Queue ``report``'s missing events again (those no repair queued already); how many."""
    if not report.missing:
        return 0
    selector = {"since": report.since.isoformat(), "until": report.until.isoformat(), "topic": topics}
    entry = audit.begin(
        conn, schema, action="repair", selector={k: v for k, v in selector.items() if v},
        planned=len(report.missing), via=via, actor=actor,
    )  # fmt: skip
    conn.commit()
    ids = [lost.delivered_id for lost in report.missing]
    done = 0
    for i in range(0, len(ids), CHUNK):
        row = conn.execute(
            query("verify_repair", schema), {"ids": int_array(ids[i : i + CHUNK]), "audit": entry}
        ).fetchone()
        conn.commit()
        done += int(row[0]) if row else 0
    audit.done(conn, schema, entry, done)
    conn.commit()
    return done
