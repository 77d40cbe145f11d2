"""One outbox inside a relay: a lane.

A relay serves the outboxes of one database (one schema each): they share its sessions, its
LISTEN connection, its heartbeat connection and its sinks. Everything that belongs to one
outbox lives in its :class:`Lane`: its partitions and key holds (:class:`~outbox.relay.ordering.Ordering`),
its batches in flight, when it may have work (woken by NOTIFY, a full batch, the poll timer),
and its own trouble (a schema dropped or not migrated: a line of its own when it starts and
when it ends, and a pause of that lane only).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import math
import random
import time
from dataclasses import dataclass, field

from outbox.capture.wal_reader import WalReader
from outbox.observe.conditions import Condition
from outbox.relay.batch import Batch
from outbox.relay.config import RelayConfig
from outbox.relay.limits import Gate, either, gates, weight_of
from outbox.relay.ordering import Ordering
from outbox.store.membership import Membership
from outbox.store.outboxes import DEFAULT_NAME, Outbox

log = logging.getLogger("outbox.relay")

LANE_PAUSE = 5.0  # seconds a lane rests after an error of its own (its schema gone, say)
# Seconds without a failed delivery before "deliveries failing" ends: a sink failing some events
# of every batch is one episode (found by the schedule explorer: a line pair per batch).
DELIVERY_SETTLE = 10.0


@dataclass
class RelayStats:
    claims: int = 0  # claim statements that went through, empty or not
    claimed: int = 0  # events claimed
    delivered: int = 0
    retried: int = 0
    dead: int = 0
    leases_lost: int = 0
    sinks_replaced: int = 0


class Wake:
    """A lane's wake-ups: the one part of a lane that threads other than the loop write.

    - The listener's thread, on a NOTIFY of the outbox's channel: :meth:`notified` (rows in its
      events table). The loop does the same when a heartbeat took new partitions, or when the
      sinks answer again after an outage and events are due at once.
    - A WAL reader's thread, on a transaction read: :meth:`read` (no sign of rows in the table).
    - The loop reads both and clears each before the work it announces: a wake-up that races the
      clear is seen at the next step. Each is a single attribute write (atomic under the GIL);
      the writer then wakes the loop (``Relay.wake``).
    """

    __slots__ = ("table_news", "woken")

    def __init__(self) -> None:
        self.woken = True  # there may be work now (the start, a NOTIFY, a transaction read)
        self.table_news = False  # its events table has new work

    def notified(self) -> None:
        self.table_news = True
        self.woken = True

    def read(self) -> None:
        self.woken = True


@dataclass
class Pace:
    """Claims paced to the sink (ClaimScheduler.pace): a slow start, a slow sink."""

    cap: int = 0  # events per claim at most (0: --batch-size)
    slowed: bool = False  # a slow batch made claims smaller, and they are not back to --batch-size yet
    fresh: bool = True  # not claimed from yet: its first claim starts at the relay's pace


@dataclass
class TableTurns:
    """WAL capture: the slot's transactions and the table's events take turns (WalIntake)."""

    turn: bool = False  # the table's turn to be claimed from next
    # Has the table work to claim (a NOTIFY since, or the last claim was full), and when to look
    # anyway (retries come due without a NOTIFY). Monotonic seconds.
    due: bool = True
    next_claim: float = 0.0


@dataclass
class Upkept:
    """What LaneUpkeep keeps of a lane: its next checks, its capture mode, its sinks' outage."""

    next_maintenance: float = 0.0  # monotonic time of the next archive partition check
    partitions_missing: bool = False  # the check found a day partition missing: create them
    next_capture: float = 0.0  # monotonic time of the next look at its capture mode
    # As last read from its capture table; "" until a look has said it: the table is not claimed
    # before (a WAL outbox switched back to table capture has older events in its slot).
    capture_mode: str = ""
    sinks_were_down: bool = False  # a sink was down since this lane's last "retry now"


@dataclass(eq=False)
class Lane:
    """One outbox's state in a relay. The loop's thread owns it, but for :class:`Wake`; each field
    is one part's to write, named above it (tests/unit/relay/test_shape.py keeps it so)."""

    outbox: Outbox
    ordering: Ordering
    name: str = field(init=False)  # the outbox's, which never changes: read, not asked, per batch
    schema: str = field(init=False)
    in_flight: list[Batch] = field(default_factory=list)  # BatchFinisher's (sent, done)
    wake: Wake = field(default_factory=Wake)  # its methods' (other threads), and the loop's
    # ClaimScheduler's: when it claims
    more_work: bool = True  # a full batch came back: claim again without waiting
    next_poll: float = 0.0  # monotonic time of the next poll without a NOTIFY
    retry_at: float = math.inf  # monotonic time the soonest retry this relay scheduled comes due
    solo_until: float = 0.0  # claims alone (not in a shared transaction) until then: after an error
    pace: Pace = field(default_factory=Pace)
    served: float = 0.0  # the events claimed for its shares (--weight)
    paused_until: float = 0.0  # the lane's own (pause): after an error of this outbox's own
    # Roster's: what it serves, and how
    leaving: bool = False  # no longer served: finish what is in flight, hand over, go
    gates: list[Gate] = field(default_factory=list)  # a gate per limit (--limit)
    skip: str | None = None  # the topics the lane's other claims leave (None: none)
    weight: int = 1  # its shares (--weight)
    # The pipelined claims' (outbox.pipelined)
    claiming: bool = False  # its claim is sent, its rows not read yet
    # The intake's
    last_work: float = 0.0  # monotonic time its last claim found events
    # WalIntake's
    table: TableTurns = field(default_factory=TableTurns)  # WAL capture: the table's turns
    # BatchRecorder's (read by RelayHealth)
    failing_since: float = 0.0  # since when every finished batch only failed (0: one delivered)
    stats: RelayStats = field(default_factory=RelayStats)
    # The upkeep's: the WAL reader of the outbox's slot (CaptureWatch), its checks' times
    wal: WalReader | None = None
    upkept: Upkept = field(default_factory=Upkept)
    trouble: Condition = field(init=False)  # this outbox's own problem (schema gone, not migrated)
    delivery: Condition = field(init=False)  # retries batch after batch: one problem, not a line each

    def __post_init__(self) -> None:
        self.name = self.outbox.name
        self.schema = self.outbox.schema
        fields = {"outbox": self.name}
        self.trouble = Condition(log, "outbox", f"{self.said}cannot be served", fields=fields)
        self.delivery = Condition(
            log, "delivery", f"{self.said}deliveries failing", fields=fields, settle=DELIVERY_SETTLE
        )

    @property
    def said(self) -> str:
        """What starts its log lines: the --dsn/--schema outbox of a relay that serves only it
        logs as it always did, without a name."""
        return "" if self.name == DEFAULT_NAME else f"outbox {self.name}: "

    @property
    def not_served(self) -> str:
        """Why the outbox is not served (its own error, its heartbeat's, its WAL slot's), or ""."""
        if self.trouble.active:
            return self.trouble.last_error
        if self.ordering.heartbeat.active:
            return self.ordering.heartbeat.last_error
        wal = self.wal
        if wal is not None and wal.condition.active:
            return f"reading its WAL slot: {wal.condition.last_error}"
        return ""

    @property
    def table_known(self) -> bool:
        """May the table be claimed? Not before a look at the capture said how it captures (a
        slot to read before the table?): a look that failed leaves it unknown (``capture_mode``
        ""), and the table waits for the next step's look (CaptureWatch.look_first)."""
        return self.wal is not None or bool(self.upkept.capture_mode)

    def pause(self, error: str, rest: float = LANE_PAUSE) -> None:
        """An error of this outbox's own: say so (once per episode) and rest ``rest`` seconds."""
        self.trouble.fail(error)
        self.paused_until = time.monotonic() + rest

    def may_claim(self, now: float, per_lane: int) -> bool:
        """Could a claim of this lane run now (a free slot of its own, not paused, not leaving)?
        A limit's batches have slots of their own (:meth:`gate_due`)."""
        if self.leaving or self.claiming or now < self.paused_until:
            return False
        return (
            len(self.in_flight) - sum(g.batches for g in self.gates) < per_lane
            if self.gates
            else (len(self.in_flight) < per_lane)
        )

    def due(self, now: float) -> bool:
        """May there be work: woken, a full batch came back, a retry it made came due, or the
        poll timer ran out."""
        return self.wake.woken or self.more_work or now >= self.next_poll or now >= self.retry_at

    def gate_due(self, now: float, per_lane: int) -> Gate | None:
        """A limit whose events may be claimed now: some may wait, its next tokens are due, and it
        has a slot (``per_lane`` batches of each limit at most)."""
        if not self.gates or self.leaving or self.claiming or now < self.paused_until:
            return None
        return next((g for g in self.gates if g.due(now) and g.batches < per_lane), None)


class Beats:
    """The lanes' heartbeats, soonest due first: the loop finds the due ones, and how long it may
    sleep, without looking at every lane. (A relay of 1,000 outboxes heartbeats 500 times a
    second; looking at every lane each time kept half a core busy while nothing happened.)

    A heap with lazy deletion: each lane has one live entry, at its ordering's ``due_at`` when
    last scheduled; an entry of a lane rescheduled or forgotten since is dropped when it surfaces.
    """

    def __init__(self) -> None:
        self.fleet_at: float | None = None  # the membership heartbeat's (outbox.membership)
        self._heap: list[tuple[float, int, Lane]] = []
        self._at: dict[Lane, float] = {}  # the time of each lane's live entry
        self._seq = itertools.count()  # ties: first scheduled, first due (lanes do not compare)

    def __len__(self) -> int:
        return len(self._at)

    def schedule(self, lane: Lane) -> None:
        """The lane's next heartbeat is when its ordering says (call after anything moved it)."""
        at = lane.ordering.due_at
        if self._at.get(lane) != at:
            self._at[lane] = at
            heapq.heappush(self._heap, (at, next(self._seq), lane))

    def forget(self, lane: Lane) -> None:
        self._at.pop(lane, None)

    def due(self, now: float, most: int) -> list[Lane]:
        """Up to ``most`` lanes whose heartbeat is due, the most overdue first. They leave the
        schedule: their heartbeat schedules them again."""
        out: list[Lane] = []
        heap = self._heap
        while heap and len(out) < most and heap[0][0] <= now:
            at, _, lane = heapq.heappop(heap)
            if self._at.get(lane) != at:
                continue  # rescheduled or forgotten since
            del self._at[lane]
            if lane.ordering.due_at > now:  # moved later without being scheduled again
                self.schedule(lane)
                continue
            out.append(lane)
        return out

    def next_at(self) -> float | None:
        """When the soonest heartbeat is due, the membership's or a lane's look (monotonic; None:
        none). Possibly earlier than any lane's: a stale entry only wakes the loop once for nothing."""
        times = [t for t in (self.fleet_at, self._heap[0][0] if self._heap else None) if t is not None]
        return min(times) if times else None


def new_lane(outbox: Outbox, config: RelayConfig, membership: Membership, *, cap: int, running: bool) -> Lane:
    """The lane of an outbox joining the relay: its partitions' ordering, a gate per limit, its
    shares, and its first claims at most ``cap`` events. Joining a running relay (``running``),
    its first heartbeat comes at a random point of the interval."""
    ordering = Ordering(
        member=membership,
        schema=outbox.schema,
        name=config.name,
        lease=config.ownership_lease,
        batch_lease=config.lease,
        ordering=config.ordering,
        on_dead=config.on_dead,
        outbox=outbox.name,
    )
    if running:
        ordering.delay_first_heartbeat(random.uniform(0, ordering.interval))
    limits = config.limits
    return Lane(
        outbox,
        ordering,
        pace=Pace(cap=cap),
        gates=gates(limits),
        skip=either([limit.glob for limit in limits]),
        weight=weight_of(config.weights, outbox.name),
    )
