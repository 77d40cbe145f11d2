"""A batch read from the WAL: sent like a claimed batch, finished into the archive, the events
table (what was not delivered) and the handed-on position, in one transaction.

Nothing of a WAL event was stored before it is written back here, so PostgreSQL sees its fields
for the first time: a row it refuses must not fail the batch as a whole (the reader would read
and send the same transactions again, without end). The statements bind a bounded number of
bytes each, and when the write-back fails on a live session, each row is tried alone: a row
refused is stored without the field PostgreSQL refused, and dead-lettered naming it."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import psycopg

from outbox import capture
from outbox.capture import write_back
from outbox.capture.wal_message import WalRow
from outbox.events import EXPIRES_OF, ClaimedEvent, Unusable
from outbox.relay.batch import PIPELINE, Batch, BatchResult
from outbox.relay.ordering import KeyHolds
from outbox.relay.retry import RetryPolicy, cap_error
from outbox.sinks.base import CORRUPT_EVENT, Dead, Delivered
from outbox.store.finishing import Written

log = logging.getLogger("outbox.relay")

_EVENT, _TEXT = itemgetter(0), itemgetter(1)  # of a WalRow


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

    from_wal = True

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
        archived: write_back.Archived | None = None
        if delivered:
            outcome = self.outcomes[i]
            assert isinstance(outcome, Delivered)
            archived = (outcome.partition, outcome.offset, outcome.ref, self.filtered.get(i))
        first: str | None = None
        for field in (None, *write_back.NEUTRAL_FIELDS, "every field"):
            event, text = write_back.without(self.stored[i], self.texts[i], field)
            error = write_back.store_alone(self.conn, schema, event, text, archived)
            if error is not None:
                first = first or error
                continue
            if field is None:
                return None
            self.stored[i], self.texts[i] = event, text
            return _Refusal(None if field == "every field" else field, first or "")
        return None  # refused whatever it holds: not this row's fields (the caller raises)

    def _write_and_commit(self, schema: str, w: Written) -> None:
        """Every event delivered (the common case): the archive, the position and the commit go
        in one round trip (pipeline mode); no row count needs checking first, as nothing here
        was claimed (three round trips held the relay's loop: decision 0004). Atomic as before:
        the server commits the three together or none of them, whether the relay dies before or
        after sending them."""
        if len(w.ok_ids) == len(self.stored) and PIPELINE:
            with self.conn.pipeline():
                self._write(schema, w)
                self.conn.commit()
        else:
            super()._write_and_commit(schema, w)

    def _write(self, schema: str, w: Written) -> None:
        write_back.write(self.conn, schema, self.stored, self.texts, w, self.after, parks=self._parks)
