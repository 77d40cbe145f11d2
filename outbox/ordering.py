"""Per-key order: partition ownership among live relays, and the keys held back in memory.

This module is the one home of ordering (``docs/ordering.md`` argues it):

- which events a relay may claim (the claim query it runs, in ordered mode
  only from the partitions it owns);
- which keys it holds back in memory while a failure of theirs is in flight;
- whether a dead letter parks its key (:attr:`Ordering.parks`).

Partitions
----------
Every event belongs to one of 64 logical partitions (a hash of its key, stored
on the row). In ordered mode a relay claims only events of partitions it owns,
so a key is delivered by one process at a time, in id order.

Each relay heartbeats every ``lease / 5`` seconds on its own autocommit
connection. A heartbeat refreshes its membership, renews its partition leases,
and moves it toward its fair share of partitions (computed from the live
relays in join order):

- too few: take free partitions, or those whose owner's lease expired;
- too many: mark the extras ``releasing`` (the claim query stops taking them)
  and hand them over once every batch that was in flight at that moment has
  finished, so the next owner can never find one of their rows still locked.

Fencing after a crash or a stall: a partition taken from an owner whose lease
expired is ``fenced_until`` that owner's sessions are gone (immediately after
a SIGKILL: the connections close) or at most its batch lease has passed (a
stalled process: PostgreSQL ends its idle transaction). Until then no one
claims from it, so a stale row lock can never make the new owner skip ahead of
an undelivered event. The claim query checks the lease itself, so a relay
whose lease expired claims nothing even before it notices. A relay that takes
back its *own* partitions after a network outage is fenced only by the sessions
it lost (pid + start time, from :class:`~outbox.sessions.Sessions`), which it
ends itself: it does not wait out the batch lease behind sessions it knows.

Key holds
---------
Within one relay, a key whose event failed (a retry, or a dead letter that
parks) must not have its later events sent before that failure is committed:
from then on the claim query skips them (an earlier event of the key has
``attempts > 0`` or a parked dead letter). Until then — while the failing
batch is still in flight — the relay holds the key's events in memory:
leaves them pending, untouched, in every batch it sends. :class:`KeyHolds`
counts, per key, the in-flight batches that hold it.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from outbox.conditions import Condition
from outbox.queries import int_array, query

log = logging.getLogger("outbox.ordering")

PARTITIONS = 64  # logical partitions, fixed by migration 0002
OWNERSHIP_LEASE = 10.0  # seconds; a dead relay's partitions are taken over within this + a heartbeat
HEARTBEAT_FRACTION = 5  # heartbeats per lease
ORDERINGS = ("key", "none")  # key: per-key order across relays; none: plain SKIP LOCKED
ON_DEAD = ("park", "continue")  # park: a dead letter holds back its key's later events


class KeyHolds:
    """Keys held back in memory, each counted by the in-flight batches that hold it."""

    def __init__(self) -> None:
        self.keys: dict[bytes, int] = {}  # key -> number of in-flight batches that hold it
        self._by_batch: dict[int, set[bytes]] = {}

    def add(self, batch: int, key: bytes) -> None:
        """An event of ``key`` failed in batch ``batch``: hold the key until that batch ends."""
        held = self._by_batch.setdefault(batch, set())
        if key not in held:
            held.add(key)
            self.keys[key] = self.keys.get(key, 0) + 1

    def release(self, batch: int) -> None:
        """Batch ``batch`` ended (its failures committed, or rolled back): drop its holds."""
        for key in self._by_batch.pop(batch, ()):
            n = self.keys[key] - 1
            if n:
                self.keys[key] = n
            else:
                del self.keys[key]


class Ordering:
    """One relay's ordering: its partitions (``tick()`` from the relay loop) and its key holds."""

    def __init__(
        self,
        *,
        connect: Callable[[], psycopg.Connection[Any]],
        schema: str,
        name: str,
        lease: float,
        batch_lease: float,
        ordering: str,
        on_dead: str,
    ) -> None:
        self.id = uuid.uuid4()
        self.name = name
        self.schema = schema
        self.lease = lease
        self.batch_lease = batch_lease
        self.ordering = ordering
        self.ordered = ordering == "key"
        # Does a dead letter hold back its key's later events (ordered mode, --on-dead park)?
        self.parks = self.ordered and on_dead == "park"
        self.holds = KeyHolds()
        self._claim = "claim_batch" if self.ordered else "claim_batch_unordered"
        self._connect = connect
        self._conn: psycopg.Connection[Any] | None = None
        self._next = 0.0
        self._readiness: str | None = None  # the relay's /readyz kind, written with each heartbeat
        self.owned: set[int] = set()
        self.lost_partitions = 0  # partitions found taken by another relay (for metrics)
        # partition -> the in-flight batches (by id) that may hold its rows
        self._releasing: dict[int, set[int]] = {}
        self.heartbeat = Condition(
            log, "heartbeat", "ownership heartbeat failing (leases lapse if this lasts)"
        )

    def claim(self, conn: psycopg.Connection[Any], limit: int) -> list[tuple[Any, ...]]:
        """Lock up to ``limit`` events this relay may deliver now, in id order (the batch's lease)."""
        # Binary results: the same Python types for these columns, without hex-decoding the
        # payloads or parsing numbers from text (fetch of 2,000 realistic rows 2.7 -> 1.2 ms).
        cur = conn.cursor(binary=True)
        return cur.execute(query(self._claim, self.schema), {"limit": limit, "owner": self.id}).fetchall()

    @property
    def interval(self) -> float:
        return self.lease / HEARTBEAT_FRACTION

    def due(self) -> bool:
        return time.monotonic() >= self._next

    def seconds_until_due(self) -> float:
        return max(0.0, self._next - time.monotonic())

    def tick(
        self,
        backend_pids: Iterable[int],
        in_flight: Iterable[int],
        stale: list[tuple[int, dt.datetime]] | None = None,
        readiness: str | None = None,
    ) -> bool:
        """Heartbeat: membership, renewals, hand-overs, acquisitions. Never raises.

        ``stale``: this relay's lost sessions (pid, start), which may live on in the server
        with row locks; they are ended, and the list is emptied once they are gone.
        ``readiness``: the kind of the relay's /readyz state, recorded for status and the console.
        Returns True when partitions were acquired (there may be work at once).
        """
        self._next = time.monotonic() + self.interval
        self._readiness = readiness
        try:
            acquired = self._tick(list(backend_pids), set(in_flight), stale if stale is not None else [])
        except psycopg.Error as exc:
            self.heartbeat.fail(str(exc))
            if self._conn is not None:
                self._conn.close()
            self._conn = None
            return False
        self.heartbeat.ok()
        return acquired

    def _tick(self, pids: list[int], in_flight: set[int], stale: list[tuple[int, dt.datetime]]) -> bool:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
            self._conn.autocommit = True
        conn = self._conn
        s = self.schema
        ttl = self.lease
        lost = {
            "stale_pids": int_array(pid for pid, _ in stale),
            "stale_starts": [started for _, started in stale],
        }
        if stale:
            row = conn.execute(query("end_stale_sessions", s), lost).fetchone()
            if row is not None and row[0]:
                log.info("ended %d of this relay's sessions lost in a network outage", row[0])
        conn.execute(
            query("relay_heartbeat", s),
            {
                "me": self.id,
                "name": self.name,
                "ttl": ttl,
                "lease": self.batch_lease,
                "pids": int_array(pids),
                "ordering": self.ordering,
                "readiness": self._readiness,
            },
        )
        if self.ordering != "key":
            return False
        renewed = conn.execute(query("renew_partitions", s), {"me": self.id, "ttl": ttl}).fetchall()
        taken = self.owned - {p for p, _ in renewed}
        if taken:
            self.lost_partitions += len(taken)
            log.warning(
                "lost ownership of partitions %s (lease expired)",
                sorted(taken),
                extra={"event": "ownership.lost"},
            )
        self.owned = {p for p, _ in renewed}
        releasing = {p for p, r in renewed if r}
        # Hand over the partitions whose in-flight batches have all finished.
        ready = [p for p in releasing if not (self._releasing.get(p, set()) & in_flight)]
        if ready:
            conn.execute(query("release_partitions", s), {"me": self.id, "parts": int_array(ready)})
            self.owned -= set(ready)
            for p in ready:
                self._releasing.pop(p, None)
            log.info("handed over partitions %s", sorted(ready))
        conn.execute(query("unfence_partitions", s), {"me": self.id, **lost})
        live = [r[0] for r in conn.execute(query("live_relays", s)).fetchall()]
        share = fair_share(PARTITIONS, live, self.id)
        keeping = self.owned - releasing
        got: list[Any] = []
        if len(keeping) > share:
            extra = sorted(keeping)[share:]
            conn.execute(query("mark_releasing", s), {"me": self.id, "parts": int_array(extra)})
            for p in extra:
                self._releasing[p] = set(in_flight)
            log.info("releasing partitions %s to rebalance", extra)
        elif len(self.owned) < share:
            got = conn.execute(
                query("acquire_partitions", s),
                {
                    "me": self.id,
                    "ttl": ttl,
                    "count": share - len(self.owned),
                    "max_lease": self.batch_lease,
                    **lost,
                },
            ).fetchall()
            if got:
                self.owned |= {r[0] for r in got}
                log.info("acquired partitions %s", sorted(r[0] for r in got))
        conn.execute(query("forget_relays", s))
        if stale:
            row = conn.execute(query("stale_sessions_alive", s), lost).fetchone()
            if row is not None and not row[0]:
                stale.clear()  # all gone: nothing of ours can hold a row lock any more
        return bool(got)

    def release_all(self) -> None:
        """Clean shutdown: hand everything over now (no batch is in flight any more)."""
        try:
            if self._conn is None or self._conn.closed:
                self._conn = self._connect()
                self._conn.autocommit = True
            self._conn.execute(query("release_all", self.schema), {"me": self.id})
            self.owned = set()
        except psycopg.Error as exc:
            log.warning("could not release partitions, they lapse with the lease: %s", exc)
        finally:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def fair_share(partitions: int, live: list[uuid.UUID], me: uuid.UUID) -> int:
    """How many partitions ``me`` should own among ``live`` relays (join order).

    Shares differ by at most one; the earliest relays take the remainder. A
    relay not (yet) in the list counts itself in last.
    """
    members = list(live) if me in live else [*live, me]
    n = len(members)
    base, extra = divmod(partitions, n)
    return base + (1 if members.index(me) < extra else 0)
