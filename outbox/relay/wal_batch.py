"""A batch read from the WAL: sent like a claimed batch, finished into the archive, the events
table (what was not delivered) and the handed-on position, in one transaction.

Nothing of a WAL event was stored before it is written back here, so PostgreSQL sees its fields
for the first time: a row it refuses must not fail the batch as a whole (the reader would read
and send the same transactions again, without end). The statements bind a bounded number of
bytes each, and when the write-back fails on a live session, each row is tried alone: a row
refused is stored without the field PostgreSQL refused, and dead-lettered naming it."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import psycopg

from outbox import capture
from outbox.capture.wal_message import WalRow
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
from outbox.relay.batch import PIPELINE, Batch, BatchResult, Written
from outbox.relay.ordering import KeyHolds
from outbox.relay.retry import RetryPolicy, cap_error
from outbox.sinks.base import CORRUPT_EVENT, Dead, Delivered
from outbox.store.queries import int_array, query

log = logging.getLogger("outbox.relay")

_EVENT, _TEXT = itemgetter(0), itemgetter(1)  # of a WalRow
# Bytes of events one write-back statement binds at most: PostgreSQL refuses a message over 1 GB,
# and a transaction of a few large events (a writer's, or a stranger's refused) came to that.
WRITE_BACK_BYTES = 64 * 1024 * 1024
# The fields a refused row is tried without, one at a time, in this order: the first whose
# neutral value PostgreSQL takes is the field it refused.
NEUTRAL_FIELDS = ("key", "headers", "expires_at", "type", "subject", "topic", "payload")


@dataclass
class _Refusal:
    """A row PostgreSQL refused: the field it was stored without (None: several), and why."""

    field: str | None
    error: str


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

    def finish(
        self, schema: str, policy: RetryPolicy, *, archive: bool, latencies: bool = True
    ) -> BatchResult:
        """As a claimed batch finishes; when PostgreSQL refuses the write-back on a live session,
        the rows it refuses are found one by one (:meth:`_find_refused`), stored without the field
        refused, the undelivered among them dead-lettered naming it, and the batch written again."""
        try:
            return super().finish(schema, policy, archive=archive, latencies=latencies)
        except psycopg.Error:
            if self.conn.closed or self.conn.broken:
                raise
            self.conn.rollback()
            with self.conn.transaction(force_rollback=True):  # the probes, each in a savepoint
                found = self._find_refused(schema, archive)
            if not found:
                raise
        return super().finish(schema, policy, archive=archive, latencies=latencies)

    def _find_refused(self, schema: str, archive: bool) -> bool:
        """Each row tried alone (a savepoint each, all rolled back by the caller): a row refused as it
        is gets the first neutral field PostgreSQL takes, and an undelivered one becomes a dead
        letter naming that field. Whether any row was refused."""
        found = False
        for i, outcome in enumerate(self.outcomes):
            delivered = type(outcome) is Delivered
            if delivered and not archive:
                continue
            refusal = self._probe(schema, i, delivered)
            if refusal is None:
                continue
            found = True
            what = f"its {refusal.field}" if refusal.field else "it"
            if delivered:
                log.warning(
                    "event %s was delivered; PostgreSQL refused %s in the archive (%s): archived without it",
                    self.stored[i].event_id, what, refusal.error,
                    extra={"event": "wal.archive_refused"},
                )  # fmt: skip
            else:
                self.events[i] = None  # a dead letter now, whatever it was (held, retried)
                why = f"corrupt event row: PostgreSQL refused {what} ({refusal.error}); kept without it"
                self.outcomes[i] = Dead(CORRUPT_EVENT, cap_error(why))
        return found

    def _probe(self, schema: str, i: int, delivered: bool) -> _Refusal | None:
        """None when row ``i`` is stored as it is; else the row is replaced by itself without the
        field PostgreSQL refused (every field, if no single one does it)."""
        conn = self.conn
        first: str | None = None
        for field in (None, *NEUTRAL_FIELDS, "every field"):
            event, text = self._without(i, field)
            columns = self._columns([event], [text])
            if delivered:
                outcome = self.outcomes[i]
                assert isinstance(outcome, Delivered)
                name = "wal_archive"
                params = {
                    "schema": schema, **columns, "partitions": int_array([outcome.partition]),
                    "offsets": int_array([outcome.offset]), "refs": [outcome.ref],
                    "filtered": [self.filtered.get(i)],
                }  # fmt: skip
            else:
                name = "wal_to_events"
                params = {**columns, "expires": [event.expires_at]}
            try:
                with conn.transaction():
                    conn.execute(query(name, schema), params)
            except psycopg.Error as exc:
                if conn.closed or conn.broken:
                    raise
                first = first or str(exc).strip().splitlines()[0]
                continue
            if field is None:
                return None
            self.stored[i], self.texts[i] = event, text
            return _Refusal(None if field == "every field" else field, first or "")
        return None  # refused whatever it holds: not this row's fields (the caller raises)

    def _without(self, i: int, field: str | None) -> tuple[ClaimedEvent, str | Unusable | None]:
        """Row ``i`` with ``field`` in its neutral value (None: as it is; "every field": all)."""
        event, text = self.stored[i], self.texts[i]
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
            for part in self._parts(range(len(ok)), ok):  # positions in ok
                whole = len(part) == n
                columns = self._columns(stored, self.texts) if whole else self._columns(
                    [stored[ok[p]] for p in part], [self.texts[ok[p]] for p in part]
                )  # fmt: skip
                refs = w.ok_refs if whole else [w.ok_refs[p] for p in part]
                conn.execute(
                    query("wal_archive", schema),
                    {
                        "schema": schema,
                        **columns,
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
            texts = self.texts
            # Each event id's new ids in insertion order (the rows' order): an id may come twice
            # (a writer's own message may repeat one), so not a plain mapping of id to id.
            new_ids: dict[str, list[int]] = {}
            for part in self._parts(range(len(rest)), rest):
                kept = [None if isinstance(texts[rest[p]], Unusable) else texts[rest[p]] for p in part]
                back = [stored[rest[p]] for p in part]
                columns = {**self._columns(back, kept), "expires": _unless_null(list(map(EXPIRES_OF, back)))}
                cur = conn.execute(query("wal_to_events", schema), columns)
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

    def _parts(self, positions: range, indexes: Sequence[int]) -> Iterator[Sequence[int]]:
        """``positions`` (of ``indexes``, the rows' indexes) in runs of at most
        :data:`WRITE_BACK_BYTES` of payload each (at least one row a run): nearly always one."""
        stored = self.stored
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
