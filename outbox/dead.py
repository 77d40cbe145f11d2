"""Dead letters and parked keys: choose them, list them, redrive or skip them.

A dead letter in ordered mode with ``--on-dead park`` holds back the later
events of its key (they are "parked"). Redrive puts it back into the outbox
under its original id, so it is delivered first and the parked events follow
in order; skip keeps it as a dead letter and releases the parked events.

Every operation works on the dead letters one :class:`Selector` chooses: by
ids, key, topic and/or an error pattern, each filter narrowing the choice.
``outbox dead list|redrive|skip`` and ``outbox retry`` all go through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from outbox import audit
from outbox.errors import ConfigError
from outbox.events import key_text
from outbox.queries import int_array, query


@dataclass(frozen=True)
class Selector:
    """Which dead letters: every filter given narrows the choice; ``everything`` means no filter."""

    ids: tuple[int, ...] = ()
    key: bytes | None = None
    topic: str | None = None
    error_like: str | None = None  # an SQL LIKE pattern on the error text
    everything: bool = False

    @property
    def filtered(self) -> bool:
        return bool(self.ids) or any(v is not None for v in (self.key, self.topic, self.error_like))

    def __post_init__(self) -> None:
        if not self.filtered and not self.everything:
            raise ConfigError("selector: give dead letter IDs, --key, --topic, --error-like or --all")


def select(conn: psycopg.Connection[Any], schema: str, selector: Selector) -> list[int]:
    """Ids of the chosen dead letters, in id order."""
    params = {
        "ids": int_array(selector.ids) if selector.ids else None,
        "key": selector.key,
        "topic": selector.topic,
        "error_like": selector.error_like,
    }
    return [int(r[0]) for r in conn.execute(query("dead_select", schema), params).fetchall()]


def details(conn: psycopg.Connection[Any], schema: str, ids: list[int]) -> list[dict[str, Any]]:
    """The dead letters ``ids`` in detail, with the number of events parked behind each."""
    rows = conn.execute(query("dead_list", schema), {"ids": int_array(ids)}).fetchall()
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


def redrive(conn: psycopg.Connection[Any], schema: str, ids: list[int]) -> int:
    """Move dead letters back into the outbox (attempts reset); returns how many moved."""
    return conn.execute(query("dead_redrive", schema), {"ids": int_array(ids)}).rowcount


def skip(conn: psycopg.Connection[Any], schema: str, ids: list[int]) -> int:
    """Release the events parked behind these dead letters; returns how many were parked."""
    return conn.execute(query("dead_skip", schema), {"ids": int_array(ids)}).rowcount


def act(
    conn: psycopg.Connection[Any],
    schema: str,
    action: str,
    ids: list[int],
    selector: dict[str, Any],
    *,
    via: str = "cli",
    actor: str | None = None,
) -> int:
    """Redrive or skip ``ids`` and record it in the audit trail, in the caller's transaction:
    the one code path of ``outbox dead redrive/skip``, ``outbox retry`` and the console."""
    do = {"redrive": redrive, "skip": skip}[action]
    entry = audit.begin(
        conn, schema, action=action, selector=selector, planned=len(ids), via=via, actor=actor
    )
    n = do(conn, schema, ids)
    audit.done(conn, schema, entry, n)
    return n
