"""A limit's claims (``--limit``): the events of one topic glob of an outbox, in batches of their
own, as many as the tokens taken from the bucket its relays share allow (``outbox.relay.limits``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import psycopg

from outbox.relay import limits
from outbox.relay.claim import Send, TableClaim, batch_of
from outbox.relay.lanes import Lane
from outbox.relay.limits import Gate
from outbox.relay.metrics import RelayMetrics
from outbox.store.membership import Membership
from outbox.store.sessions import Link, Sessions

GATE_RETRY = 1.0  # seconds before a limit whose tokens could not be taken (an error) tries again
CAP_RECHECK = 0.05  # seconds before a limit at its in-flight cap looks again (another relay's may end)


class GateIntake:
    """Claims a limit's batches through ``table`` and hands them on (``send``: the
    dispatcher's). ``metrics_on``: whether metrics are kept."""

    def __init__(
        self,
        sessions: Sessions,
        link: Link,
        membership: Membership,
        table: TableClaim,
        metrics: RelayMetrics,
        *,
        send: Send,
        metrics_on: Callable[[], bool],
    ) -> None:
        self.sessions = sessions
        self.link = link
        self.membership = membership
        self.table = table
        self.metrics = metrics
        self._send = send
        self._metrics_on = metrics_on

    def claim_gate(self, lane: Lane, gate: Gate, most: int) -> int:
        """Events of one limit (--limit) of ``lane``, in a batch of their own: as many as the
        tokens taken from the bucket its relays share allow now, ``most`` at most. None taken:
        the limit waits for its next token; the events wait in the table."""
        sessions = self.sessions
        now = time.monotonic()
        if not sessions.available():
            return 0
        if not lane.table_known:  # the capture look failed: the events wait
            gate.next_try = now + GATE_RETRY
            return 0
        try:
            granted, wait = limits.take(self.link.get(), self.membership.id, lane.schema, gate, most)
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                self.link.lost()
            gate.throttle(now, now + GATE_RETRY)
            lane.pause(f"limit {gate.limit.glob}: taking tokens failed: {sessions.clean(exc)}")
            return 0
        if not granted:  # the rate's next token, or (in-flight cap) the next batch to finish
            self._throttled(lane, gate, gate.throttle(now, now + (wait or CAP_RECHECK)))
            return 0
        self._throttled(lane, gate, gate.flowing(now))
        gate.next_try = now
        claimed = self.table.claim(lane, granted, gate.only, gate.skip)
        if claimed is None:
            return 0
        conn, rows, claim_start = claimed
        if len(rows) < granted:
            gate.pending = False  # nothing more of it now: the next NOTIFY, poll or backlog claim
            # The tokens it could not use go back (another relay of the outbox may have the
            # events: its partitions), and its events in flight are what it claimed.
            limits.report(self.link, self.membership.id, lane.schema, gate, len(rows), granted - len(rows))
        if not rows:
            sessions.give_back(conn)
            return 0
        batch = batch_of(lane, conn, rows)
        batch.gate = gate
        gate.flying += batch.size
        gate.batches += 1
        return self._send(lane, batch, claim_start, granted, True)

    def _throttled(self, lane: Lane, gate: Gate, seconds: float) -> None:
        if seconds and self._metrics_on():
            self.metrics.limit_throttled.inc((lane.name, gate.limit.glob), seconds)
