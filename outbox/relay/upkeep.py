"""Lane upkeep: what the loop does besides claiming. The archive's day partitions, each outbox's
capture mode (a slot to read starts its reader), and the sinks: replaced when unhealthy, chained
where they cannot keep a key's order, probed while down, and the events that failed only to reach
them made due at once when they answer again."""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol, TypeVar

import psycopg

from outbox import capture, extras
from outbox.capture.wal_reader import WAL_READER, WalReader
from outbox.errors import MissingExtra
from outbox.relay.finisher import BatchFinisher
from outbox.relay.lanes import Lane, RelayStats
from outbox.relay.metrics import RelayMetrics
from outbox.relay.scheduler import ClaimScheduler
from outbox.relay.wal_batch import WalBatch
from outbox.sinks import router
from outbox.sinks.base import UNREACHABLE_KINDS, Reachable, Sink, keeps_key_order
from outbox.sinks.chains import KeyChains
from outbox.store.queries import query
from outbox.store.sessions import Sessions

log = logging.getLogger("outbox.relay")

T = TypeVar("T")
PARTITION_MAINTENANCE = 3600.0  # seconds between archive partition checks
MAINTENANCE_RETRY = 10.0  # seconds before trying again after it failed
DAYS_AHEAD = 3  # the day partitions ensure_delivered_partitions() keeps ahead (its default)
CAPTURE_CHECK = 30.0  # seconds between looks at an outbox's capture mode (a slot to read?)
RETRIES_PER_STEP = 8  # outboxes whose failures are made due at once after an outage, a loop step
CAPTURE_CHECKS = 5.0  # looks a second at most, in all: a relay of 1,000 outboxes looks every 200 s


class Host(Protocol):
    """What the upkeep uses of the relay."""

    sessions: Sessions
    sink: Sink | None
    sink_factory: Callable[[], Sink]
    chains: dict[str, KeyChains]
    stats: RelayStats
    metrics: RelayMetrics
    scheduler: ClaimScheduler
    finisher: BatchFinisher

    def lane_error(self, lane: Lane, conn: psycopg.Connection[Any], error: str) -> None: ...

    def wal_read(self, lane: Lane) -> None: ...

    def use_sink(self, sink: Sink) -> None: ...


class LaneUpkeep:
    def __init__(self, relay: Host) -> None:
        self.relay = relay
        self.next_maintenance_check = 0.0
        self.next_capture_check = 0.0
        self._slots: tuple[str, set[str]] | None = None  # the database and its slots, as last read
        self._slots_until = 0.0  # ... and until when that reading is used (monotonic)
        self.sinks_up = True  # every sink answered the last probe
        self.after_outage = False  # some outbox's failures wait for the sinks to answer again

    def due(self, now: float) -> None:
        """What is due now: a partition check, a capture check (one outbox each, a step), the
        retries after an outage (a few outboxes a step)."""
        self.retry_after_outage()
        if now >= self.next_maintenance_check:
            self.maintain_partitions(now)
        if now >= self.next_capture_check:
            self.check_capture(now)

    # -- partitions and capture ----------------------------------------------------------

    def maintain_partitions(self, now: float) -> None:
        """The archive's day partitions of each outbox whose hourly check is due (one a step); the
        outboxes due are first asked about in one statement, and only those missing a partition
        get the call that creates it (at start, 1,000 outboxes were 1,000 transactions on the
        loop's thread in the middle of their first drain)."""
        rotation = self.relay.scheduler.rotation
        # The first due, not the list of them: at start every outbox is due, and a list each step
        # was a scan of every outbox per outbox (25 million looks at 5,000 outboxes).
        lane = next((x for x in rotation if now >= x.upkept.next_maintenance and not x.leaving), None)
        if lane is not None and not lane.upkept.partitions_missing:
            self._ask_partitions(now)
            lane = next((x for x in rotation if now >= x.upkept.next_maintenance and not x.leaving), None)
        if lane is None:
            self.next_maintenance_check = min(
                (x.upkept.next_maintenance for x in rotation), default=now + PARTITION_MAINTENANCE
            )
            return
        lane.upkept.next_maintenance = now + PARTITION_MAINTENANCE
        lane.upkept.partitions_missing = False
        done = self.on_session(
            lane,
            "archive partition maintenance",
            lambda conn: conn.execute(query("ensure_partitions", lane.schema)),
        )
        if done is None:
            lane.upkept.next_maintenance = now + MAINTENANCE_RETRY

    def _ask_partitions(self, now: float) -> None:
        """One look at every due outbox's day partitions: those that have them all are checked
        for the hour; the rest are marked for ensure_partitions, one a step. Without a session
        free, the due outboxes get their calls as before; when the look fails, each gets its call,
        which says which outbox is in trouble."""
        due = [x for x in self.relay.scheduler.rotation if now >= x.upkept.next_maintenance and not x.leaving]
        sessions = self.relay.sessions
        conn = sessions.take()
        if conn is None:
            return
        try:
            rows = conn.execute(
                query("partitions_missing", due[0].schema),
                {"schemas": [x.schema for x in due], "days": DAYS_AHEAD},
            ).fetchall()
            missing = {row[0] for row in rows}
        except psycopg.OperationalError as exc:
            sessions.lost(conn, f"archive partition check failed: {sessions.clean(exc)}")
            return
        except psycopg.Error:
            missing = {x.schema for x in due}
            sessions.roll_back(conn)
        else:
            sessions.end(conn)
        for x in due:
            if x.schema in missing:
                x.upkept.partitions_missing = True
            else:
                x.upkept.next_maintenance = now + PARTITION_MAINTENANCE

    def on_session(self, lane: Lane, what: str, work: Callable[[psycopg.Connection[Any]], T]) -> T | None:
        """``work`` on a session of the pool, committed; its result, or None when no session was
        free or it failed (said once: the session lost, or this outbox's own trouble)."""
        sessions = self.relay.sessions
        conn = sessions.take()
        if conn is None:
            return None
        try:
            result = work(conn)
            conn.commit()
        except psycopg.OperationalError as exc:
            sessions.lost(conn, f"{what} failed: {sessions.clean(exc)}")
            return None
        except psycopg.Error as exc:
            self.relay.lane_error(lane, conn, f"{what} failed: {sessions.clean(exc)}")
            return None
        sessions.give_back(conn)
        return result

    def check_capture(self, now: float) -> None:
        """Each outbox's capture mode, every CAPTURE_CHECK s (one outbox a step): a slot to read
        starts its reader; a slot that went (dropped) stops it."""
        rotation = self.relay.scheduler.rotation
        # (A lane not claimed from yet is looked at before its first claim: table_known.)
        lane = next((x for x in rotation if 0 < x.upkept.next_capture <= now and not x.leaving), None)
        if lane is None:
            self.next_capture_check = min(
                (x.upkept.next_capture for x in rotation if x.upkept.next_capture),
                default=now + CAPTURE_CHECK,
            )
            return
        self.look_at_capture(lane, now)

    def capture_every(self) -> float:
        """Seconds between looks at an outbox's capture mode: CAPTURE_CHECKS a second in all."""
        return max(CAPTURE_CHECK, len(self.relay.scheduler.rotation) / CAPTURE_CHECKS)

    def table_known(self, lane: Lane, now: float) -> bool:
        """May ``lane``'s table be claimed? Its capture is looked at before its first claim (a
        slot to read before the table?); a look that failed leaves it unknown (``capture_mode``
        ""), and the table waits: the next claim looks again."""
        if not lane.upkept.next_capture:
            self.look_at_capture(lane, now)
        return lane.wal is not None or bool(lane.upkept.capture_mode)

    def look_at_capture(self, lane: Lane, now: float) -> None:
        """One look at an outbox's capture mode: the database's slots and publications say
        "table" for an outbox that has none; the others are looked at one by one."""
        if self._slotless(lane, now):
            lane.upkept.next_capture = now + random.uniform(0.5, 1.0) * self.capture_every()
            lane.upkept.capture_mode = "table"
            return
        self.check_lane_capture(lane, now)

    def _slotless(self, lane: Lane, now: float) -> bool:
        """Has the outbox no replication slot, no publication and no reader? One look at the
        database's slots and publications (at most every CAPTURE_CHECK s) says it for every
        outbox: those need no capture check of their own (a thousand outboxes' first claims were
        a thousand checks, and the idle relay's periodic ones five transactions a second). An
        outbox switched to WAL capture has its slot first, and its reader within CAPTURE_CHECK s
        of the next look. Its publication counts too: a failover to a standby that did not
        synchronise the slot keeps the publication, and a relay that first looked then took the
        outbox for table capture (ready, claiming an empty table, the WAL's events never read
        and nothing said) where its reader says the slot is lost."""
        if lane.wal is not None:
            return False
        if now >= self._slots_until:
            found = self.on_session(lane, "capture check", partial(_database_slots, lane.schema))
            if found is not None:
                self._slots, self._slots_until = found, now + CAPTURE_CHECK
        return self._slots is not None and not _reads_wal(lane.schema, self._slots)

    def refuse_wal_without_reader(self) -> None:
        """At start: refuse, in one line naming the extra, to serve an outbox that has a WAL slot to
        read when the reader's client (psycopg2: a replication connection) is not installed. Found
        out in the loop, it was a traceback after the relay had joined and claimed."""
        lanes = list(self.relay.scheduler.rotation)
        if not lanes or not extras.missing("psycopg2"):
            return
        first = lanes[0]
        slots = self.on_session(first, "capture check", partial(_database_slots, first.schema))
        if slots is None:  # the database did not answer: the loop's capture checks will say so
            return
        for lane in lanes:
            if _reads_wal(lane.schema, slots):
                extras.require("psycopg2", f"outbox {lane.name}: {WAL_READER}")

    def check_lane_capture(self, lane: Lane, now: float) -> None:
        lane.upkept.next_capture = now + self.capture_every()
        found = self.on_session(lane, "capture check", lambda conn: capture.state(conn, lane.schema))
        if found is None:
            # Never known (the first look failed): looked at again before the next claim. A relay
            # that took such an outbox for table capture until a look 10 s later claimed its
            # table ahead of the older events in its slot, and said it was ready after a failover
            # that lost the slot.
            lane.upkept.next_capture = now + MAINTENANCE_RETRY if lane.upkept.capture_mode else 0.0
            return
        lane.upkept.capture_mode = found.mode
        if found.reads_slot and lane.wal is None:
            if extras.missing("psycopg2"):  # switched to WAL capture since the relay started
                # Its table may not be claimed before the slot is read (the slot's events came
                # first): the outbox rests until a relay with the reader's client serves it.
                lane.pause(str(MissingExtra(WAL_READER, "psycopg2")))
                lane.paused_until = math.inf
                return
            lane.wal = WalReader(
                lane.outbox.dsn,
                lane.schema,
                found,
                partial(self.relay.wal_read, lane),
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

    # -- the sinks ---------------------------------------------------------------------------

    def replace_sink(self) -> None:
        """A new sink from the factory; the unhealthy one's in-flight batches settled first."""
        relay = self.relay
        if relay.sink is not None:
            relay.finisher.await_all()
            relay.stats.sinks_replaced += 1
            relay.metrics.sinks_replaced.inc()
            rotation = relay.scheduler.rotation
            log.error(
                "sink unhealthy, replacing it; settling %d in-flight batches",
                sum(len(lane.in_flight) for lane in rotation),
                extra={"event": "sink.replaced"},
            )
            # The old client reports what it can (Kafka: what was acked, and its purged messages
            # as failed) and goes. The in-flight batches are then finished, not rolled back: what
            # was delivered is archived once, not sent again by the next claim; the rest counts
            # as failed for an unreachable sink (the key holds its later events, per-key order),
            # due again as soon as the replacement answers (sinks_back), not after a backoff.
            relay.sink.close(0)
            relay.finisher.settle_unreported()
            self.sinks_were_down()
        relay.use_sink(relay.sink_factory())
        relay.chains = {}
        for lane in relay.scheduler.rotation:
            self.chain(lane)

    def chain(self, lane: Lane) -> None:
        """A sink that cannot order a key's in-flight events gets key chains, one set per outbox:
        keys are an outbox's own, and one outbox's failure must not hold another's events. A
        router over several sinks gets them too, across its sinks: a key's event waits for the
        key's events in flight to another sink (chains.py)."""
        relay = self.relay
        assert relay.sink is not None
        inner = router.unwrap(relay.sink)
        if lane.ordering.ordered and not keeps_key_order(inner):
            route = inner.destination if isinstance(inner, router.Router) else None
            relay.chains[lane.name] = KeyChains(relay.sink, parks=lane.ordering.parks, route=route)

    def sinks_were_down(self) -> None:
        """A sink was down: every outbox's events that failed only for that are due at once when
        every sink answers again (:meth:`retry_after_outage`)."""
        for lane in self.relay.scheduler.rotation:
            lane.upkept.sinks_were_down = True
        self.after_outage = True

    def sinks_back(self) -> None:
        """With the membership heartbeat (every few seconds): probe the sinks counted down; while
        one is, every outbox's failures for it wait to be retried at once when it answers."""
        relay = self.relay
        sink = relay.sink
        if sink is None:
            return
        down = False
        for each in router.sinks_of(sink):
            inner = router.unwrap(each)
            if isinstance(inner, Reachable) and inner.trouble():
                inner.probe()
                down = down or bool(inner.trouble())
        self.sinks_up = not down
        if down:
            relay.scheduler.sinks_seen_down = time.monotonic()
            self.sinks_were_down()

    def retry_after_outage(self) -> None:
        """Every sink answers again after an outage: the events of each outbox that failed only to
        reach them are due now, not after their backoff (a few outboxes a loop step)."""
        if not (self.after_outage and self.sinks_up):
            return
        waiting = [lane for lane in self.relay.scheduler.rotation if lane.upkept.sinks_were_down]
        for lane in waiting[:RETRIES_PER_STEP]:
            self._retry_unreachable_now(lane)
        if len(waiting) <= RETRIES_PER_STEP:
            self.after_outage = any(lane.upkept.sinks_were_down for lane in waiting)

    def _retry_unreachable_now(self, lane: Lane) -> None:
        n = self.on_session(
            lane,
            "retrying after the outage",
            lambda conn: (
                conn.execute(
                    query("retry_unreachable_now", lane.schema), {"kinds": sorted(UNREACHABLE_KINDS)}
                ).rowcount
            ),
        )
        if n is None:
            return
        lane.upkept.sinks_were_down = False
        if n > 0:
            log.info(
                "sinks answer again: %d events that failed to reach them are due now",
                n,
                extra={"outbox": lane.name},
            )
            lane.wake.notified()


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
