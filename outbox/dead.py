"""Dead letters and parked keys: list, redrive, skip.

A dead letter in ordered mode with ``--on-dead park`` holds back the later
events of its key (they are "parked"). Redrive puts it back into the outbox
under its original id, so it is delivered first and the parked events follow
in order; skip keeps it as a dead letter and releases the parked events.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox.batch import int_array
from outbox.queries import query
from outbox.status import key_text


def list_dead(
    conn: psycopg.Connection[Any], schema: str, *, topic: str | None, key: bytes | None, limit: int
) -> list[dict[str, Any]]:
    rows = conn.execute(query("dead_list", schema), {"topic": topic, "key": key, "limit": limit}).fetchall()
    return [
        {
            "id": int(i),
            "event_id": e,
            "topic": t,
            "key": key_text(k),
            "attempts": int(a),
            "error": err,
            "failed_at": f.isoformat(),
            "parked": bool(p),
            "waiting": int(w),
        }
        for i, e, t, k, a, err, f, p, w in rows
    ]


def render(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no dead letters"
    lines = [f"{'id':>10}  {'topic':<20} {'key':<20} {'parked':<6} {'waiting':>7}  error"]
    for r in rows:
        lines.append(
            f"{r['id']:>10}  {r['topic'][:20]:<20} {str(r['key'])[:20]:<20} "
            f"{'yes' if r['parked'] else 'no':<6} {r['waiting']:>7}  {r['error'][:80]}"
        )
    return "\n".join(lines)


def select(
    conn: psycopg.Connection[Any], schema: str, *, ids: list[int], key: bytes | None, all_: bool
) -> list[int]:
    rows = conn.execute(
        query("dead_select", schema), {"ids": int_array(ids), "key": key, "all": all_}
    ).fetchall()
    return sorted(int(r[0]) for r in rows)


def redrive(conn: psycopg.Connection[Any], schema: str, ids: list[int]) -> int:
    """Move dead letters back into the outbox; returns how many moved."""
    return conn.execute(query("dead_redrive", schema), {"ids": int_array(ids)}).rowcount


def skip(conn: psycopg.Connection[Any], schema: str, ids: list[int]) -> int:
    """Release the events parked behind these dead letters; returns how many were parked."""
    return conn.execute(query("dead_skip", schema), {"ids": int_array(ids)}).rowcount
