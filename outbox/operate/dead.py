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

import datetime as dt
from dataclasses import dataclass, replace
from typing import Any

import psycopg

from outbox.errors import ConfigError
from outbox.escape import escape
from outbox.events import key_text
from outbox.operate import audit
from outbox.store.queries import int_array, query

# Dead letters of messages the relay could not verify as events of this outbox: a WAL message no
# writer of it signed (any role may emit one), one that is no event's encoding, a stored row that
# is not an event. A bulk redrive never takes them (a catch-all route would deliver a stranger's
# content); by id, only with --include-unverified.
UNVERIFIED = ("unsigned_event", "corrupt_event")


@dataclass(frozen=True)
class Selector:
    """Which dead letters: every filter given narrows the choice; ``everything`` means no filter.
    The CLI's and the console's one selection, so that the command line the console shows for
    an action chooses exactly what the action chose."""

    ids: tuple[int, ...] = ()
    key: bytes | None = None
    topic: str | None = None
    error_like: str | None = None  # an SQL LIKE pattern on the error text
    everything: bool = False
    error: str | None = None  # a substring of the error, in any case (the console's filter)
    fingerprint: str | None = None  # the error with ids and numbers masked (a console group)
    since: dt.datetime | None = None  # failed at or after
    until: dt.datetime | None = None  # failed before
    high_water: int | None = None  # made up to this seq (a console page's high-water mark)
    # Also what the relay could not verify as an event of this outbox (UNVERIFIED kinds). Listing
    # and skipping them is harmless; redriving one puts a stranger's content on the way to a sink,
    # so a redrive takes them only by id, when asked (--include-unverified).
    unverified: bool = False
    # Also the expired (kind expired): listing and skipping them is harmless; a redrive delivers
    # one late (without its expiry), so it takes them only when asked (--include-expired).
    expired: bool = False

    @property
    def filtered(self) -> bool:
        given = (self.key, self.topic, self.error_like, self.error, self.fingerprint, self.since, self.until)
        return bool(self.ids) or any(v is not None for v in given)

    def __post_init__(self) -> None:
        if not self.filtered and not self.everything:
            raise ConfigError("selector: give dead letter IDs, --key, --topic, --error-like or --all")

    def also_unverified(self) -> Selector:
        """The same choice, with the dead letters that are no verified event, and the expired
        (list, skip)."""
        return replace(self, unverified=True, expired=True)

    def audited(self) -> dict[str, Any]:
        """The selector as the audit trail keeps it: the filters given, the key as text, times in
        ISO form (:func:`outbox.operate.audit.command` makes the equivalent command line from it)."""
        chosen: dict[str, Any] = {
            "key": key_text(self.key),
            "topic": self.topic,
            "error_like": self.error_like,
            "error": self.error,
            "fingerprint": self.fingerprint,
            "since": None if self.since is None else self.since.isoformat(),
            "until": None if self.until is None else self.until.isoformat(),
            "high_water": self.high_water,
            "ids": list(self.ids) or None,
            "include_unverified": True if self.unverified else None,
            "include_expired": True if self.expired else None,
        }
        return {k: v for k, v in chosen.items() if v is not None}

    def params(self, *, after: int = 0, limit: int | None = None) -> dict[str, Any]:
        return {
            "ids": int_array(self.ids) if self.ids else None,
            "key": self.key,
            "topic": self.topic,
            "error_like": self.error_like,
            "error": self.error,
            "fingerprint": self.fingerprint,
            "since": self.since,
            "until": self.until,
            "high_water": self.high_water,
            "unverified": self.unverified,
            "unverified_kinds": list(UNVERIFIED),
            "expired": self.expired,
            "after": after,
            "limit": limit,
        }


def select(
    conn: psycopg.Connection[Any],
    schema: str,
    selector: Selector,
    *,
    after: int = 0,
    limit: int | None = None,
) -> list[int]:
    """Ids of the chosen dead letters, in id order (``after``/``limit``: a page of them)."""
    rows = conn.execute(query("dead_select", schema), selector.params(after=after, limit=limit))
    return [int(r[0]) for r in rows.fetchall()]


def count(conn: psycopg.Connection[Any], schema: str, selector: Selector) -> int:
    """How many dead letters ``selector`` chooses."""
    row = conn.execute(query("dead_count", schema), selector.params()).fetchone()
    return int(row[0]) if row else 0


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
            "kind": kind,
        }
        for i, e, t, k, a, err, f, p, w, kind in rows
    ]


def render(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "no dead letters"
    lines = [f"{'id':>10}  {'topic':<20} {'key':<20} {'parked':<6} {'waiting':>7}  error"]
    for r in rows:
        lines.append(
            f"{r['id']:>10}  {escape(r['topic'])[:20]:<20} {escape(str(r['key']))[:20]:<20} "
            f"{'yes' if r['parked'] else 'no':<6} {r['waiting']:>7}  "
            + ("(unverified: --include-unverified to redrive) " if r.get("kind") in UNVERIFIED else "")
            + ("(expired: --include-expired to redrive) " if r.get("kind") == "expired" else "")
            + escape(r["error"])[:80]
        )
    return "\n".join(lines)


def redrive(
    conn: psycopg.Connection[Any],
    schema: str,
    ids: list[int],
    *,
    unverified: bool = False,
    expired: bool = False,
) -> int:
    """Move dead letters back into the outbox (attempts reset); returns how many moved. Those
    that are no verified event of this outbox (UNVERIFIED) stay, unless ``unverified``; the
    expired stay unless ``expired``, and go back without their expiry."""
    params = {
        "ids": int_array(ids),
        "unverified": unverified,
        "unverified_kinds": list(UNVERIFIED),
        "expired": expired,
    }
    return conn.execute(query("dead_redrive", schema), params).rowcount


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
    entry = audit.begin(
        conn, schema, action=action, selector=selector, planned=len(ids), via=via, actor=actor
    )
    if action == "redrive":
        n = redrive(
            conn,
            schema,
            ids,
            unverified=bool(selector.get("include_unverified")),
            expired=bool(selector.get("include_expired")),
        )
    else:
        n = {"skip": skip}[action](conn, schema, ids)
    audit.done(conn, schema, entry, n)
    return n
