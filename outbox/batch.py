"""A claimed batch: its row locks are the lease, its commit is the fenced ack.

The relay claims a batch with ``SELECT … FOR UPDATE SKIP LOCKED`` and keeps
that transaction open while the sink works. The row locks mark the owner: no
other worker can claim these events until the transaction ends. The relay's
connections run with ``idle_in_transaction_session_timeout = lease``, so a
worker that stalls past its lease has its session ended by PostgreSQL itself,
its locks released, and its later ack refused (the connection is gone) — it
cannot archive, retry or dead-letter anything after that. Every state change
also checks the number of rows it really changed.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox import tracing
from outbox.events import ClaimedEvent, CorruptEvent, decode_row
from outbox.queries import query
from outbox.retry import RetryPolicy, cap_error
from outbox.sinks.base import Dead, Delivered, Outcome, Retry

log = logging.getLogger("outbox.relay")


class FencingError(RuntimeError):
    """A state change touched other rows than the batch owns: the lease was lost."""


@dataclass
class Settled:
    """What finishing a batch did, for stats and logs."""

    delivered: int = 0
    retried: int = 0
    dead: int = 0
    held: int = 0
    latencies: list[float] = field(default_factory=list)
    dead_events: list[tuple[int, str]] = field(default_factory=list)


class Batch:
    """Events claimed in one transaction on one connection, and their outcomes."""

    def __init__(
        self, conn: psycopg.Connection[Any], rows: list[tuple[Any, ...]], *, hold_dead: bool = True
    ) -> None:
        self.conn = conn
        # Does a dead event hold back its key (ordered mode, --on-dead park)?
        self.hold_dead = hold_dead
        self.ids: list[int] = [row[0] for row in rows]
        self.attempts: list[int] = [row[7] for row in rows]
        self.events: list[ClaimedEvent | None] = []
        self.outcomes: list[Outcome | None] = [None] * len(rows)
        self.waiting = len(rows)
        self.abandoned = False
        # Keys with an event that failed in this batch: until this batch's retry
        # is committed (and blocks them in the claim query), the relay holds
        # their later events in every batch it sends.
        self.failed_keys: set[bytes] = set()
        # OpenTelemetry "send <topic>" spans of this batch (empty when tracing is off).
        self.spans: dict[str, Any] = {}
        for i, row in enumerate(rows):
            try:
                self.events.append(decode_row(row))
            except CorruptEvent as exc:
                self.events.append(None)
                self.settle(i, Dead(f"corrupt event row: {exc}"))

    def __len__(self) -> int:
        return len(self.ids)

    def settle(self, index: int, outcome: Outcome) -> None:
        """Record the outcome of event ``index`` (called once per event)."""
        if self.abandoned or self.outcomes[index] is not None:
            return
        self.outcomes[index] = outcome
        self.waiting -= 1
        if type(outcome) is Delivered:  # the common case, checked first: hot path
            return
        if isinstance(outcome, Retry) or (self.hold_dead and isinstance(outcome, Dead)):
            event = self.events[index] if index < len(self.events) else None
            if event is not None and event.key is not None:
                self.failed_keys.add(event.key)

    def hold(self, index: int) -> None:
        """Leave event ``index`` untouched: an earlier event of its key failed in this batch."""
        self.waiting -= 1

    @property
    def complete(self) -> bool:
        return self.waiting == 0

    def finish(self, schema: str, policy: RetryPolicy, *, archive: bool, park: bool) -> Settled:
        """Write every outcome in one transaction (one statement per kind) and commit.

        Raises FencingError (after rolling back) if a statement changed other
        rows than expected, and psycopg.OperationalError if the lease was lost.
        """
        done = Settled()
        ok_ids: list[int] = []
        ok_parts: list[int | None] = []
        ok_offsets: list[int | None] = []
        retry_ids: list[int] = []
        retry_delays: list[float] = []
        retry_errors: list[str] = []
        dead_ids: list[int] = []
        dead_errors: list[str] = []
        for i, outcome in enumerate(self.outcomes):
            if outcome is None:
                done.held += 1
            elif isinstance(outcome, Delivered):
                ok_ids.append(self.ids[i])
                ok_parts.append(outcome.partition)
                ok_offsets.append(outcome.offset)
            elif isinstance(outcome, Dead):
                dead_ids.append(self.ids[i])
                dead_errors.append(cap_error(outcome.reason))
            elif isinstance(outcome, Retry):
                made = self.attempts[i] + 1
                if policy.exhausted(made):
                    dead_ids.append(self.ids[i])
                    dead_errors.append(cap_error(f"gave up after {made} attempts: {outcome.reason}"))
                else:
                    retry_ids.append(self.ids[i])
                    retry_delays.append(policy.next_delay(made))
                    retry_errors.append(cap_error(outcome.reason))

        conn = self.conn
        try:
            if ok_ids:
                name = "archive_delivered" if archive else "delete_delivered"
                cur = conn.execute(
                    query(name, schema),
                    {
                        "ids": int_array(ok_ids),
                        "partitions": int_array(ok_parts),
                        "offsets": int_array(ok_offsets),
                    },
                )
                _check_rows(cur.rowcount, len(ok_ids), "archive")
            if retry_ids:
                cur = conn.execute(
                    query("schedule_retry", schema),
                    {"ids": int_array(retry_ids), "delays": retry_delays, "errors": retry_errors},
                )
                _check_rows(cur.rowcount, len(retry_ids), "retry")
            if dead_ids:
                cur = conn.execute(
                    query("dead_letter", schema),
                    {"ids": int_array(dead_ids), "errors": dead_errors, "park": park},
                )
                _check_rows(cur.rowcount, len(dead_ids), "dead-letter")
            conn.commit()
        except FencingError:
            conn.rollback()
            raise
        done.delivered = len(ok_ids)
        done.retried = len(retry_ids)
        done.dead = len(dead_ids)
        done.dead_events = list(zip(dead_ids, dead_errors, strict=False))
        return done

    def release(self) -> None:
        """Give the batch up: roll back so its events can be claimed again at once."""
        self.abandoned = True
        if self.spans:
            now = time.time_ns()
            tracing.end_batch(self.spans, {}, now, now, "released")
            self.spans = {}
        with contextlib.suppress(psycopg.Error):  # if the connection is gone, so are the locks
            self.conn.rollback()


def int_array(values: list[int] | list[int | None]) -> str:
    """A PostgreSQL array literal of integers.

    Sent as one text parameter and cast in SQL: psycopg would otherwise dump a
    list element by element in Python, a measurable cost per acked event.
    """
    return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"


def _check_rows(changed: int, expected: int, what: str) -> None:
    if changed != expected:
        raise FencingError(f"{what} changed {changed} rows, expected {expected}: the batch's lease was lost")
