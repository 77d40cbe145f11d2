"""A WAL batch's commit: the events read from the WAL, stored for the first time once their sink
answered, and the position they reach handed on, in one transaction. The delivered go to the
archive; the rest go into the events table (then retried, dead-lettered or parked there as
table events are); the position is recorded for the reader to confirm once committed.

Nothing of a WAL event was stored before, so PostgreSQL sees its fields here for the first time:
each statement binds a bounded number of bytes (:data:`WRITE_BACK_BYTES`), and
:func:`store_alone` stores one row in its own savepoint, so that the batch can find a row
PostgreSQL refuses and store it without the field refused (:func:`without`)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

import psycopg

from outbox.capture.pgoutput import Position, lsn_text
from outbox.events import (
    CORRUPT_TOPIC,
    CREATED_OF,
    EVENT_ID_OF,
    EXPIRES_OF,
    KEY_OF,
    MAX_KEY_BYTES,
    PAYLOAD_OF,
    SUBJECT_OF,
    TOPIC_OF,
    TYPE_OF,
    ClaimedEvent,
    Unusable,
)
from outbox.store import finishing
from outbox.store.finishing import Written
from outbox.store.queries import int_array, query

# Bytes of events one write-back statement binds at most: PostgreSQL refuses a message over 1 GB,
# and a transaction of a few large events (a writer's, or a stranger's refused) came to that.
WRITE_BACK_BYTES = 64 * 1024 * 1024
# The fields a refused row is tried without, one at a time, in this order: the first whose
# neutral value PostgreSQL takes is the field it refused.
NEUTRAL_FIELDS = ("key", "headers", "expires_at", "type", "subject", "topic", "payload")

Texts = Sequence[str | Unusable | None]  # each event's headers as JSON text (Unusable: no event)
# A delivered event's archive columns: the sink's partition, offset and reference, and the
# transform that dropped it (None: sent).
Archived = tuple[int | None, int | None, str | None, str | None]


def write(
    conn: psycopg.Connection[Any],
    schema: str,
    stored: Sequence[ClaimedEvent],
    texts: Texts,
    w: Written,
    after: Position,
    *,
    parks: bool,
) -> None:
    """The batch's statements (the caller commits). ``w``'s ids are indexes in ``stored``; its
    dead letters' ids become the rows' ids in the events table."""
    n = len(stored)
    if w.ok_ids and w.archive:
        ok = w.ok_ids
        for part in parts(stored, range(len(ok)), ok):  # positions in ok
            whole = len(part) == n
            cols = columns(stored, texts) if whole else columns(
                [stored[ok[p]] for p in part], [texts[ok[p]] for p in part]
            )  # fmt: skip
            refs = w.ok_refs if whole else [w.ok_refs[p] for p in part]
            conn.execute(
                query("wal_archive", schema),
                {
                    "schema": schema,
                    **cols,
                    "partitions": int_array(w.ok_parts if whole else [w.ok_parts[p] for p in part]),
                    "offsets": int_array(w.ok_offsets if whole else [w.ok_offsets[p] for p in part]),
                    "refs": [] if refs.count(None) == len(refs) else refs,
                    "filtered": w.ok_filtered if whole or not w.ok_filtered else [
                        w.ok_filtered[p] for p in part
                    ],
                },
            )  # fmt: skip
    rest = [] if len(w.ok_ids) == n else sorted(set(range(n)).difference(w.ok_ids))
    if rest:
        # A message that is no event goes in without its headers (they may be no JSON, or
        # none jsonb takes): it is dead-lettered, its content kept as the payload.
        # Each event id's new ids in insertion order (the rows' order): an id may come twice
        # (a writer's own message may repeat one), so not a plain mapping of id to id.
        new_ids: dict[str, list[int]] = {}
        for part in parts(stored, range(len(rest)), rest):
            kept = [None if isinstance(texts[rest[p]], Unusable) else texts[rest[p]] for p in part]
            back = [stored[rest[p]] for p in part]
            cols = {**columns(back, kept), "expires": unless_null(list(map(EXPIRES_OF, back)))}
            cur = conn.execute(query("wal_to_events", schema), cols)
            for id_, event_id in sorted(cur.fetchall()):
                new_ids.setdefault(event_id, []).append(int(id_))
        real = {i: new_ids[stored[i].event_id].pop(0) for i in rest}
        retry_ids, dead_ids = [real[i] for i in w.retry_ids], [real[i] for i in w.dead_ids]
        finishing.write_failed(conn, schema, w, retry_ids, dead_ids, parks=parks)
        w.dead_events[:] = [(real[i], reason) for i, reason in w.dead_events]
    hand_on(conn, schema, after)


def hand_on(conn: psycopg.Connection[Any], schema: str, after: Position) -> None:
    """The position the batch's events reach, recorded (the reader confirms it once committed)."""
    position = {
        "lsn": lsn_text(after.lsn),
        "part_commit": lsn_text(after.commit) if after.commit else None,
        "part_events": after.events if after.commit else 0,
    }
    conn.execute(query("wal_positions_superseded", schema), position)
    conn.execute(query("wal_handed_on", schema), position)


def store_alone(
    conn: psycopg.Connection[Any],
    schema: str,
    event: ClaimedEvent,
    text: str | None,
    archived: Archived | None,
) -> str | None:
    """One row stored in a savepoint of its own: to the archive (``archived``: delivered), else to
    the events table. None when PostgreSQL took it, else the first line of its error."""
    cols = columns([event], [text])
    if archived is not None:
        partition, offset, ref, filtered = archived
        name = "wal_archive"
        params = {
            "schema": schema, **cols, "partitions": int_array([partition]),
            "offsets": int_array([offset]), "refs": [ref], "filtered": [filtered],
        }  # fmt: skip
    else:
        name = "wal_to_events"
        params = {**cols, "expires": [event.expires_at]}
    try:
        with conn.transaction():
            conn.execute(query(name, schema), params)
    except psycopg.Error as exc:
        if conn.closed or conn.broken:
            raise
        return str(exc).strip().splitlines()[0]
    return None


def without(
    event: ClaimedEvent, text: str | Unusable | None, field: str | None
) -> tuple[ClaimedEvent, str | None]:
    """The row with ``field`` in its neutral value (None: as it is; "every field": all)."""
    if isinstance(text, Unusable):
        text = None
    every = field == "every field"
    changes: dict[str, Any] = {}
    if every or field == "key":
        changes["key"] = None
    if every or field == "headers":
        text = None
    if every or field == "expires_at":
        changes["expires_at"] = None
    if every or field == "type":
        changes["type"] = None
    if every or field == "subject":
        changes["subject"] = None
    if every or field == "topic":
        changes["topic"] = CORRUPT_TOPIC
    if every or field == "payload":
        changes["payload"] = b""
    if every:
        changes["created_at"] = time.time()
    return (event._replace(**changes) if changes else event), text


def parts(
    stored: Sequence[ClaimedEvent], positions: range, indexes: Sequence[int]
) -> Iterator[Sequence[int]]:
    """``positions`` (of ``indexes``, the rows' indexes in ``stored``) in runs of at most
    :data:`WRITE_BACK_BYTES` of payload each (at least one row a run): nearly always one."""
    # Keys are bounded (MAX_KEY_BYTES), the payloads are not: their sum, in C, nearly always says "one".
    if sum(map(len, map(PAYLOAD_OF, stored))) <= WRITE_BACK_BYTES - len(stored) * MAX_KEY_BYTES:
        yield positions
        return
    sizes = [len(stored[i].payload) + len(stored[i].key or b"") for i in indexes]
    part: list[int] = []
    size = 0
    for p in positions:
        if part and size + sizes[p] > WRITE_BACK_BYTES:
            yield part
            part, size = [], 0
        part.append(p)
        size += sizes[p]
    if part:
        yield part


def columns(events: Sequence[ClaimedEvent], headers: Sequence[Any]) -> dict[str, Any]:
    """The events' columns for wal_archive and wal_to_events (``headers``: their JSON texts).
    The ids (UUIDs, checked by the reader) and creation times (floats) go as array literals
    joined in C, and a column NULL for every event as an empty array (unnest pads it):
    psycopg dumps a list element by element in Python (decision 0004)."""
    return {
        "event_ids": "{" + ",".join(map(EVENT_ID_OF, events)) + "}",
        "topics": list(map(TOPIC_OF, events)),
        "keys": unless_null(list(map(KEY_OF, events))),
        "payloads": list(map(PAYLOAD_OF, events)),
        "headers": unless_null(headers),
        "created": "{" + ",".join(map(repr, map(CREATED_OF, events))) + "}",
        "types": unless_null(list(map(TYPE_OF, events))),
        "subjects": unless_null(list(map(SUBJECT_OF, events))),
    }


def unless_null(column: Sequence[Any]) -> Sequence[Any]:
    """``column``, or an empty array when every value is NULL (unnest pads it with NULLs)."""
    return [] if column.count(None) == len(column) else column
