"""The archive of delivered events: replay a window of it, purge what is old.

The archive (``delivered``) is partitioned by delivery day, so retention is
``DROP TABLE`` of whole days, not a ``DELETE`` storm; a default partition
catches rows if a day partition was ever missing, and is purged in chunks.
Replay queues archived events again as new events (new event-ids, header
``outbox-replay-of``), chunk by chunk.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Callable
from typing import Any

import psycopg

from outbox.errors import ConfigError
from outbox.events import key_bytes
from outbox.operate import audit
from outbox.store.queries import query

REPLAY_CHUNK = 5000  # archived events re-queued per transaction
PURGE_CHUNK = 10_000  # rows deleted per statement from the default partition
_PARTITION = re.compile(r"^delivered_p(\d{8})$")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)\s*$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)


def parse_duration(text: str, field: str) -> dt.timedelta:
    """``30d``, ``12h``, ``15m``, ``90s``, ``2w`` as a timedelta; ValueError naming ``field``."""
    m = _DURATION.match(text)
    if not m:
        raise ConfigError(f"{field}: expected a duration like 30d, 12h, 15m, got {text!r}")
    return dt.timedelta(seconds=float(m.group(1)) * _UNITS[m.group(2)])


def parse_time(text: str, field: str, now: dt.datetime) -> dt.datetime:
    """An ISO 8601 time (UTC if no zone), or a duration meaning that long ago."""
    if _DURATION.match(text):
        return now - parse_duration(text, field)
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ConfigError(f"{field}: expected an ISO time or a duration like 2h, got {text!r}") from None
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)


def check_window(since: dt.datetime, until: dt.datetime, now: dt.datetime, field: str = "until") -> None:
    """A replay's window: ``until`` after ``since`` and not in the future (a window still open
    would take in events delivered while it replays, its own fresh copies among them)."""
    if until <= since:
        raise ConfigError(f"{field}: must be after since ({since.isoformat()})")
    if until > now:
        raise ConfigError(f"{field}: must not be in the future (now is {now.isoformat(timespec='seconds')})")


def replay_count(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    since: dt.datetime,
    until: dt.datetime,
    topic: str | None,
    key: bytes | None,
    upto: int | None = None,
) -> tuple[int, int]:
    """How many archived events the window holds (up to id ``upto``), and the highest id among
    them: what a replay of the same window bound by that id re-sends."""
    row = conn.execute(
        query("replay_count", schema),
        {"since": since, "until": until, "topic": topic, "key": key, "upto": upto},
    ).fetchone()
    return (int(row[0]), int(row[1])) if row else (0, 0)


def replay(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    since: dt.datetime,
    until: dt.datetime,
    topic: str | None,
    key: bytes | None,
    upto: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Queue archived events again (those up to id ``upto``), chunk by chunk (each chunk
    committed); returns how many."""
    after_at, after_id, total = EPOCH, -1, 0
    while True:
        row = conn.execute(
            query("replay_chunk", schema),
            {
                "since": since,
                "until": until,
                "topic": topic,
                "key": key,
                "upto": upto,
                "after_at": after_at,
                "after_id": after_id,
                "limit": REPLAY_CHUNK,
            },
        ).fetchone()
        conn.commit()
        n = int(row[0]) if row else 0
        if not n or row is None:
            return total
        total += n
        after_at, after_id = row[1], int(row[2])
        if progress is not None:
            progress(total)


def replay_recorded(
    conn: psycopg.Connection[Any],
    schema: str,
    *,
    since: dt.datetime,
    until: dt.datetime,
    topic: str | None,
    key: str | None,
    planned: int,
    upto: int,
    via: str = "cli",
    actor: str | None = None,
    progress: Callable[[int], None] | None = None,
) -> int:
    """:func:`replay` recorded in the audit trail: the one code path of ``outbox replay`` and the
    console. It replays what its preview counted: ``planned`` events up to id ``upto``, or
    nothing (ConfigError) if the window holds another number now (a purge since). The action
    is recorded (and committed) before the first chunk and its count after the last, so a
    replay cut off shows as unfinished. ``key`` as given (UTF-8 text, or ``0x…``)."""
    now = dt.datetime.now(dt.timezone.utc)
    check_window(since, until, now)
    held, _ = replay_count(conn, schema, since=since, until=until, topic=topic, key=key_bytes(key), upto=upto)
    if held != planned:
        raise ConfigError(
            f"planned: the window holds {held} archived events now, the preview counted {planned}; "
            "preview it again"
        )
    chosen = {
        "since": since.isoformat(), "until": until.isoformat(), "topic": topic, "key": key, "upto": upto,
    }  # fmt: skip
    entry = audit.begin(
        conn, schema, action="replay", selector={k: v for k, v in chosen.items() if v}, planned=planned,
        via=via, actor=actor,
    )  # fmt: skip
    conn.commit()
    done = replay(
        conn, schema, since=since, until=until, topic=topic, key=key_bytes(key), upto=upto, progress=progress
    )
    audit.done(conn, schema, entry, done)
    conn.commit()
    return done


def purge_plan(conn: psycopg.Connection[Any], schema: str, cutoff: dt.datetime) -> list[str]:
    """Archive day partitions that hold only rows delivered before ``cutoff``."""
    names = [r[0] for r in conn.execute(query("archive_partitions", schema), {"schema": schema})]
    out = []
    for name in names:
        m = _PARTITION.match(name)
        if not m:
            continue
        day = dt.datetime.strptime(m.group(1), "%Y%m%d").replace(tzinfo=dt.timezone.utc)
        if day + dt.timedelta(days=1) <= cutoff:
            out.append(name)
    return out


def purge(
    conn: psycopg.Connection[Any],
    schema: str,
    cutoff: dt.datetime,
    partitions: list[str],
    progress: Callable[[int], None] | None = None,
) -> int:
    """Drop ``partitions`` and delete older rows from the default partition; returns rows deleted
    from the default partition."""
    for i, name in enumerate(partitions):
        conn.execute(query("drop_archive_partition", schema, identifiers={"partition": name}))
        conn.commit()
        if progress is not None:
            progress(i + 1)
    deleted = 0
    while True:
        n = conn.execute(
            query("purge_default_chunk", schema), {"cutoff": cutoff, "limit": PURGE_CHUNK}
        ).rowcount
        conn.commit()
        deleted += max(n, 0)
        if n < PURGE_CHUNK:
            return deleted
