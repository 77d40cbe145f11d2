"""The audit trail: every redrive, skip, replay and purge, from the CLI or the console.

One row per action, written by the code path that acts, so the CLI and the console cannot
differ: who (the operator, and the database role), when, through what, the selector, and how
many were planned and done. Redrive and skip write it in their own transaction; replay and
purge, which commit chunk by chunk, write it before they start and record what they did when
they finish (``done`` stays NULL if they were cut off). :func:`command` gives the ``outbox``
command line that does the same, for the console to show next to each action.
"""

from __future__ import annotations

import datetime as dt
import getpass
import json
import shlex
import socket
from typing import Any

import psycopg

from outbox.escape import escape
from outbox.store.queries import query

ACTIONS = ("redrive", "skip", "replay", "purge", "repair")
VIAS = ("cli", "console")


def cli_actor() -> str:
    """Who runs the CLI: the operating-system user at this host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary user)
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


def begin(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    action: str,
    selector: dict[str, Any],
    planned: int,
    via: str = "cli",
    actor: str | None = None,
) -> int:
    """Record an action about to act on ``planned`` items, in the caller's transaction; its id."""
    if action not in ACTIONS:
        raise ValueError(f"audit action: one of {ACTIONS}, got {action!r}")
    if via not in VIAS:
        raise ValueError(f"audit via: one of {VIAS}, got {via!r}")
    row = conn.execute(
        query("audit_begin", schema),
        {
            "actor": actor or cli_actor(),
            "via": via,
            "action": action,
            "selector": json.dumps(selector, sort_keys=True, default=str),
            "planned": planned,
        },
    ).fetchone()
    assert row is not None
    return int(row[0])


def done(conn: psycopg.Connection[Any], schema: str, audit_id: int, n: int) -> None:
    """Record how many the action ``audit_id`` did, in the caller's transaction."""
    conn.execute(query("audit_done", schema), {"id": audit_id, "done": n})


def recent(conn: psycopg.Connection[Any], schema: str, limit: int = 50) -> list[dict[str, Any]]:
    """The latest ``limit`` actions, newest first."""
    rows = conn.execute(query("audit_list", schema), {"limit": limit}).fetchall()
    out = []
    for i, at, actor, db_user, via, action, selector, planned, n, finished in rows:
        chosen = json.loads(selector)
        out.append(
            {
                "id": int(i),
                "at": at.isoformat(),
                "actor": actor,
                "db_user": db_user,
                "via": via,
                "action": action,
                "selector": chosen,
                "planned": int(planned),
                "done": None if n is None else int(n),
                "finished_at": None if finished is None else finished.isoformat(),
                "command": command(action, chosen),
            }
        )
    return out


def command(action: str, selector: dict[str, Any]) -> str:
    """The ``outbox`` command line that acts on what ``selector`` chose (schema and DSN left out).

    Dead letters: every filter the action chose by (the CLI takes each, and chooses as the
    console does: :class:`outbox.operate.dead.Selector`), ``--ids`` when it chose ids, and the page's
    high-water mark; with no filter, ``--all``. Replay: the window and the highest archived id
    its preview counted; purge: the cutoff.
    """
    parts = ["outbox"]
    if action in ("redrive", "skip"):
        parts += ["dead", action]
        for name in ("key", "topic", "error_like", "error", "fingerprint", "since", "until"):
            if selector.get(name) is not None:
                parts += [f"--{name.replace('_', '-')}", str(selector[name])]
        if selector.get("ids"):
            parts += ["--ids", *map(str, selector["ids"])]
        if len(parts) == 3:
            parts.append("--all")
        if selector.get("high_water") is not None:
            parts += ["--high-water", str(selector["high_water"])]
        if action == "redrive" and selector.get("include_unverified"):
            parts.append("--include-unverified")
        if action == "redrive" and selector.get("include_expired"):
            parts.append("--include-expired")
    elif action == "replay":
        parts += ["replay", "--since", str(selector["since"]), "--until", str(selector["until"])]
        for name in ("topic", "key", "upto"):
            if selector.get(name) is not None:
                parts += [f"--{name}", str(selector[name])]
    elif action == "purge":
        parts += ["purge", "--older-than", str(selector["older_than"])]
    return " ".join(shlex.quote(p) for p in parts) + " --yes"


def render(rows: list[dict[str, Any]]) -> str:
    """The trail as a table, newest first."""
    if not rows:
        return "no actions recorded"
    lines = [
        f"{'id':>6}  {'at':<19}  {'via':<7} {'actor':<24} {'action':<8} {'planned':>8} {'done':>8}  command"
    ]
    for r in rows:
        at = dt.datetime.fromisoformat(r["at"]).strftime("%Y-%m-%d %H:%M:%S")
        n = "-" if r["done"] is None else str(r["done"])
        lines.append(
            f"{r['id']:>6}  {at:<19}  {r['via']:<7} {escape(r['actor'])[:24]:<24} {r['action']:<8} "
            f"{r['planned']:>8} {n:>8}  {escape(r['command'])}"
        )
    return "\n".join(lines)
