"""``outbox transform test``: a transform run on the latest archived events of its topics, each
shown before and after; nothing is written, nothing is sent."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.errors import CorruptEvent
from outbox.events import ClaimedEvent, decode_row, key_text
from outbox.store.queries import glob_regex, query
from outbox.transform import TRANSFORM_FAILED, Transform
from outbox.transform.spec import TransformFailed

# Windows of the archive looked in, newest first, until enough events are found (None: all of it).
WINDOWS = (dt.timedelta(hours=1), dt.timedelta(days=1), dt.timedelta(days=30), None)
SHOWN = 300  # characters of a payload shown at most


@dataclass(frozen=True)
class Trial:
    """One archived event, and what the transform made of it."""

    before: ClaimedEvent
    after: ClaimedEvent | None  # None: dropped (or failed: see error)
    error: str | None = None  # why it would be a dead letter of kind transform_failed


def latest(conn: psycopg.Connection[Any], schema: str, glob: str, n: int) -> list[ClaimedEvent]:
    """The ``n`` latest archived events whose topic matches ``glob``, oldest first."""
    rows: list[tuple[Any, ...]] = []
    now = dt.datetime.now(dt.timezone.utc)
    for window in WINDOWS:
        since: Any = "-infinity" if window is None else now - window
        params = {"since": since, "topics": glob_regex(glob), "limit": n}
        rows = conn.execute(query("archive_latest", schema), params).fetchall()
        if len(rows) >= n:
            break
    conn.rollback()
    out = []
    for row in reversed(rows):
        try:
            out.append(decode_row(row))
        except CorruptEvent:  # archived before the checks of this version: not worth a trial
            continue
    return out


def run(transform: Transform, events: list[ClaimedEvent]) -> list[Trial]:
    """Each event through ``transform``, as the relay would run it."""
    out = []
    for event in events:
        try:
            out.append(Trial(event, transform.run(event)))
        except TransformFailed as exc:
            out.append(Trial(event, None, str(exc)))
    return out


def render(trials: list[Trial]) -> str:
    """Each trial as lines for a terminal: the event before, then after (or what became of it).
    Values are shown escaped (repr): a payload's control characters never reach the terminal."""
    if not trials:
        return "no archived events of these topics"
    lines = []
    for t in trials:
        lines.append(f"event {t.before.event_id}")
        lines.append("  before: " + _shown(t.before))
        if t.error is not None:
            lines.append(f"  after:  dead letter ({TRANSFORM_FAILED}): {t.error!r}")
        elif t.after is None:
            lines.append("  after:  dropped (archived as filtered)")
        elif t.after is t.before:
            lines.append("  after:  unchanged")
        else:
            lines.append("  after:  " + _shown(t.after))
    return "\n".join(lines)


def _shown(e: ClaimedEvent) -> str:
    payload = e.payload.decode("utf-8", "backslashreplace")
    if len(payload) > SHOWN:
        payload = payload[:SHOWN] + f"... ({len(e.payload)} bytes)"
    headers = {name: _value(v) for name, v in e.headers if name != "event-id"}
    parts = [f"topic={e.topic!r}", f"key={key_text(e.key)!r}"]
    if e.type is not None:
        parts.append(f"type={e.type!r}")
    if e.subject is not None:
        parts.append(f"subject={e.subject!r}")
    parts += [f"headers={headers!r}", f"payload={payload!r}"]
    return " ".join(parts)


def _value(v: str | bytes | None) -> str | None:
    return v.decode("utf-8", "backslashreplace") if isinstance(v, bytes) else v


__all__ = ["Trial", "latest", "render", "run"]
