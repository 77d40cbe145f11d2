"""Each outbox's capture mode, looked at before its first claim and then every CAPTURE_CHECK s: a
slot to read starts the outbox's WAL reader, a slot that went stops it. The looks are this
service's, in their own part of the loop's step: a claim only asks whether one was done
(:attr:`Lane.table_known <outbox.relay.lanes.Lane.table_known>`), and starts no reader."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import psycopg

from outbox import capture, extras
from outbox.capture.wal_reader import WAL_READER, WalReader
from outbox.errors import MissingExtra
from outbox.relay.lanes import Lane
from outbox.relay.upkeep.chores import Chores
from outbox.relay.wal_batch import WalBatch
from outbox.store.queries import query

log = logging.getLogger("outbox.relay")

CAPTURE_CHECK = 30.0  # seconds between looks at an outbox's capture mode (a slot to read?)
CAPTURE_CHECKS = 5.0  # looks a second at most, in all: a relay of 1,000 outboxes looks every 200 s
LOOK_RETRY = 10.0  # seconds before looking again at an outbox whose look failed (its mode known)


class CaptureWatch:
    """``rotation``: the outboxes served (the scheduler's list); ``wal_read``: what a lane's reader
    calls when it has read transactions (the loop's wake)."""

    def __init__(self, chores: Chores, rotation: Sequence[Lane], wal_read: Callable[[Lane], None]) -> None:
        self.chores = chores
        self.rotation = rotation
        self._wal_read = wal_read
        self._next = 0.0  # monotonic time of the next periodic look
        self._slots: tuple[str, set[str]] | None = None  # the database and its slots, as last read
        self._slots_until = 0.0  # ... and until when that reading is used (monotonic)
        # Outboxes whose capture no look has said yet (joined, or the look failed): looked at
        # before the step's claims, which leave a table unclaimed until then (table_known).
        self._unlooked: dict[Lane, None] = {}

    def joined(self, lane: Lane) -> None:
        """``lane`` joined: its capture is looked at before its first claim."""
        self._unlooked[lane] = None

    def next_at(self) -> float:
        return 0.0 if self._unlooked else self._next

    def due(self, now: float) -> None:
        """The first looks at outboxes that joined, then a periodic look (one outbox a step)."""
        if self._unlooked:
            self.look_first(now)
        if now >= self._next:
            self._look_next(now)

    def look_first(self, now: float) -> None:
        """The first look at each outbox whose capture is not known yet, in the order they joined,
        until one fails (the database does not answer: the next step tries again)."""
        for lane in list(self._unlooked):
            if lane.leaving or lane.upkept.next_capture:
                del self._unlooked[lane]
                continue
            self._look(lane, now)
            if not lane.upkept.next_capture:  # the look failed
                return
            del self._unlooked[lane]

    def _look_next(self, now: float) -> None:
        lane = next((x for x in self.rotation if 0 < x.upkept.next_capture <= now and not x.leaving), None)
        if lane is None:
            self._next = min(
                (x.upkept.next_capture for x in self.rotation if x.upkept.next_capture),
                default=now + CAPTURE_CHECK,
            )
            return
        self._look(lane, now)

    def _every(self) -> float:
        """Seconds between looks at an outbox's capture mode: CAPTURE_CHECKS a second in all."""
        return max(CAPTURE_CHECK, len(self.rotation) / CAPTURE_CHECKS)

    def _look(self, lane: Lane, now: float) -> None:
        """One look at an outbox's capture mode: the database's slots and publications say
        "table" for an outbox that has none; the others are looked at one by one."""
        slotless = self._slotless(lane, now)
        if slotless is None:  # the database did not answer (or no session was free)
            self._failed(lane, now)
        elif slotless:
            lane.upkept.next_capture = now + random.uniform(0.5, 1.0) * self._every()
            lane.upkept.capture_mode = "table"
        else:
            self._look_at_slot(lane, now)

    def _failed(self, lane: Lane, now: float) -> None:
        """A look that failed. Never known (the first look failed): looked at again before the
        next claim. A relay that took such an outbox for table capture until a look 10 s later
        claimed its table ahead of the older events in its slot, and said it was ready after a
        failover that lost the slot."""
        lane.upkept.next_capture = now + LOOK_RETRY if lane.upkept.capture_mode else 0.0
        if not lane.upkept.next_capture:
            self._unlooked[lane] = None

    def _slotless(self, lane: Lane, now: float) -> bool | None:
        """Has the outbox no replication slot, no publication and no reader? One look at the
        database's slots and publications (at most every CAPTURE_CHECK s) says it for every
        outbox: those need no capture check of their own (a thousand outboxes' first claims were
        a thousand checks, and the idle relay's periodic ones five transactions a second). An
        outbox switched to WAL capture has its slot first, and its reader within CAPTURE_CHECK s
        of the next look. Its publication counts too: a failover to a standby that did not
        synchronise the slot keeps the publication, and a relay that first looked then took the
        outbox for table capture (ready, claiming an empty table, the WAL's events never read
        and nothing said) where its reader says the slot is lost. None when it cannot be said
        (the look failed)."""
        if lane.wal is not None:
            return False
        if now >= self._slots_until:
            found = self.chores.on_session(lane, "capture check", partial(_database_slots, lane.schema))
            if found is None:
                return None
            self._slots, self._slots_until = found, now + CAPTURE_CHECK
        return self._slots is not None and not _reads_wal(lane.schema, self._slots)

    def refuse_wal_without_reader(self) -> None:
        """At start: refuse, in one line naming the extra, to serve an outbox that has a WAL slot to
        read when the reader's client (psycopg2: a replication connection) is not installed. Found
        out in the loop, it was a traceback after the relay had joined and claimed."""
        lanes = list(self.rotation)
        if not lanes or not extras.missing("psycopg2"):
            return
        first = lanes[0]
        slots = self.chores.on_session(first, "capture check", partial(_database_slots, first.schema))
        if slots is None:  # the database did not answer: the loop's capture checks will say so
            return
        for lane in lanes:
            if _reads_wal(lane.schema, slots):
                extras.require("psycopg2", f"outbox {lane.name}: {WAL_READER}")

    def _look_at_slot(self, lane: Lane, now: float) -> None:
        lane.upkept.next_capture = now + self._every()
        found = self.chores.on_session(lane, "capture check", lambda conn: capture.state(conn, lane.schema))
        if found is None:
            self._failed(lane, now)
            return
        lane.upkept.capture_mode = found.mode
        if found.reads_slot and lane.wal is None:
            if extras.missing("psycopg2"):  # switched to WAL capture since the relay started
                # Its table may not be claimed before the slot is read (the slot's events came
                # first): the outbox rests until a relay with the reader's client serves it.
                lane.pause(str(MissingExtra(WAL_READER, "psycopg2")), rest=math.inf)
                return
            lane.wal = WalReader(
                lane.outbox.dsn,
                lane.schema,
                found,
                partial(self._wal_read, lane),
                name=lane.said and lane.name,
            )
            lane.wal.start()
            log.info(
                "%sreading events from the WAL slot %s (%s capture)",
                lane.said,
                found.slot,
                found.mode,
                extra={"event": "wal.reading", "outbox": lane.name},
            )
        elif (
            not found.reads_slot
            and lane.wal is not None
            and not any(isinstance(b, WalBatch) for b in lane.in_flight)
        ):
            self.stop_reader(lane)

    @staticmethod
    def stop_reader(lane: Lane) -> None:
        if lane.wal is not None:
            lane.wal.stop()
            lane.wal.join(timeout=2.0)
            lane.wal = None


def _database_slots(schema: str, conn: psycopg.Connection[Any]) -> tuple[str, set[str]]:
    """The database's name and the names of its replication slots and publications."""
    row = conn.execute(query("database_slots", schema)).fetchone()
    return (str(row[0]), {*row[1], *row[2]}) if row else ("", set())


def _reads_wal(schema: str, found: tuple[str, set[str]]) -> bool:
    """Has ``schema``'s outbox a slot to read in this database (by either name it may have), or
    its publication: WAL capture with the slot lost, which its reader finds out and says?"""
    database, names = found
    return capture.publication_name(schema) in names or any(
        name in names for name in capture.slot_names(schema, database)
    )
