"""A batch read from the WAL: sent like a claimed batch, finished into the archive, the events
table (what was not delivered) and the handed-on position, in one transaction."""

from __future__ import annotations

from collections.abc import Sequence
from operator import itemgetter
from typing import Any

import psycopg

from outbox import capture
from outbox.capture.wal_message import WalRow
from outbox.events import (
    CREATED_OF,
    EVENT_ID_OF,
    EXPIRES_OF,
    KEY_OF,
    PAYLOAD_OF,
    SUBJECT_OF,
    TOPIC_OF,
    TYPE_OF,
    ClaimedEvent,
    Unusable,
)
from outbox.relay.batch import PIPELINE, Batch, Written
from outbox.relay.ordering import KeyHolds
from outbox.sinks.base import Dead
from outbox.store.queries import int_array, query

_EVENT, _TEXT = itemgetter(0), itemgetter(1)  # of a WalRow


class WalBatch(Batch):
    """Events read from the WAL, sent like a claimed batch. Finishing writes the delivered
    ones to the archive and the rest into the events table (then retried, dead-lettered or
    parked there as table events are), records the position, commits; the relay then lets
    the reader confirm it."""

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        rows: list[WalRow],
        after: capture.Position,
        *,
        holds: KeyHolds | None = None,
        parks: bool = False,
    ) -> None:
        n = len(rows)
        # Each event's id is its index here until it has one of the table's (see _write). The
        # reader decoded the events: they are sent as they are.
        self._start(conn, list(range(n)), [0] * n, holds, parks)
        self.stored: list[ClaimedEvent] = list(map(_EVENT, rows))  # what is kept, all of them
        self.texts: list[str | Unusable | None] = list(map(_TEXT, rows))  # their headers' JSON
        self.events = list(self.stored)
        self.expiring = any(map(EXPIRES_OF, self.stored))
        if Unusable in set(map(type, self.texts)):  # a message that is no event: dead at once
            for i, text in enumerate(self.texts):
                if isinstance(text, Unusable):
                    self.events[i] = None
                    self.corrupt += 1
                    self.settle(i, Dead(text.kind, text.reason))
        self.after = after  # the WAL's position once these events are handed on

    def _locked_id(self, index: int) -> int | None:
        return None  # not in the table (yet): nothing locked there

    def _write_and_commit(self, schema: str, w: Written) -> None:
        """Every event delivered (the common case): the archive, the position and the commit go
        in one round trip (pipeline mode); no row count needs checking first, as nothing here
        was claimed. Three round trips held the relay's loop 1-2 ms per batch, during which
        the transactions read waited. Atomic as before: the server commits the three together
        or none of them, whether the relay dies before or after sending them."""
        if len(w.ok_ids) == len(self.stored) and PIPELINE:
            with self.conn.pipeline():
                self._write(schema, w)
                self.conn.commit()
        else:
            super()._write_and_commit(schema, w)

    def _write(self, schema: str, w: Written) -> None:
        conn = self.conn
        stored = self.stored
        n = len(stored)
        if w.ok_ids and w.archive:
            ok = w.ok_ids
            columns = self._columns(stored, self.texts) if len(ok) == n else self._columns(
                [stored[i] for i in ok], [self.texts[i] for i in ok]
            )  # fmt: skip
            conn.execute(
                query("wal_archive", schema),
                {
                    "schema": schema,
                    **columns,
                    "partitions": int_array(w.ok_parts),
                    "offsets": int_array(w.ok_offsets),
                    "refs": [] if w.ok_refs.count(None) == len(w.ok_refs) else w.ok_refs,
                    "filtered": w.ok_filtered,
                },
            )
        rest = [] if len(w.ok_ids) == n else sorted(set(range(n)).difference(w.ok_ids))
        if rest:
            # A message that is no event goes in without its headers (they may be no JSON, or
            # none jsonb takes): it is dead-lettered, its content kept as the payload.
            texts = self.texts
            kept = [None if isinstance(texts[i], Unusable) else texts[i] for i in rest]
            back = [stored[i] for i in rest]
            columns = {**self._columns(back, kept), "expires": _unless_null(list(map(EXPIRES_OF, back)))}
            cur = conn.execute(query("wal_to_events", schema), columns)
            # Each event id's new ids in insertion order (the rows' order): an id may come twice
            # (a writer's own message may repeat one), so not a plain mapping of id to id.
            new_ids: dict[str, list[int]] = {}
            for id_, event_id in sorted(cur.fetchall()):
                new_ids.setdefault(event_id, []).append(int(id_))
            real = {i: new_ids[stored[i].event_id].pop(0) for i in rest}
            self._failed(schema, w, [real[i] for i in w.retry_ids], [real[i] for i in w.dead_ids])
            w.dead_events[:] = [(real[i], reason) for i, reason in w.dead_events]
        after = self.after
        position = {
            "lsn": capture.lsn_text(after.lsn),
            "part_commit": capture.lsn_text(after.commit) if after.commit else None,
            "part_events": after.events if after.commit else 0,
        }
        conn.execute(query("wal_positions_superseded", schema), position)
        conn.execute(query("wal_handed_on", schema), position)

    @staticmethod
    def _columns(events: Sequence[ClaimedEvent], headers: Sequence[Any]) -> dict[str, Any]:
        """The events' columns for wal_archive and wal_to_events (``headers``: their JSON texts).
        The ids (UUIDs, checked by the reader) and creation times (floats) go as array literals
        joined in C, and a column NULL for every event as an empty array (unnest pads it):
        psycopg dumps a list element by element in Python, 3.5 us an event for all eight."""
        return {
            "event_ids": "{" + ",".join(map(EVENT_ID_OF, events)) + "}",
            "topics": list(map(TOPIC_OF, events)),
            "keys": _unless_null(list(map(KEY_OF, events))),
            "payloads": list(map(PAYLOAD_OF, events)),
            "headers": _unless_null(headers),
            "created": "{" + ",".join(map(repr, map(CREATED_OF, events))) + "}",
            "types": _unless_null(list(map(TYPE_OF, events))),
            "subjects": _unless_null(list(map(SUBJECT_OF, events))),
        }


def _unless_null(column: Sequence[Any]) -> Sequence[Any]:
    """``column``, or an empty array when every value is NULL (unnest pads it with NULLs)."""
    return [] if column.count(None) == len(column) else column
