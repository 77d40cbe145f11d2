"""A relay's membership in its database: one row, one heartbeat, the lease of every partition.

A relay's partition leases in every outbox of a database last as long as its row in
``outbox_fleet.relays`` (migration 0018), which one statement renews every ownership lease / 5.
A relay of a thousand quiet outboxes used to renew its leases in each of them: 500 statements a
second, and half its loop, for nothing.

An outbox's own ownership rows change only when its ownership does, so the relay looks at an
outbox (:meth:`outbox.relay.ordering.Ordering.tick`) only when:

- it joins the outbox (its first look takes its share);
- the heartbeat finds the database's other members changed: a relay came, went (its lease ran
  out, or it left), or joined or left an outbox (:attr:`Membership.changed` says so with the
  next heartbeat);
- the outbox's ownership is not settled (fewer partitions than its share, some being handed
  over, or fenced): every interval, as before;
- and once every ``SETTLED_LOOK`` seconds or so in any case.
"""

from __future__ import annotations

import datetime as dt
import logging
import time
import uuid
from collections.abc import Iterable

import psycopg

from outbox.observe.conditions import Condition
from outbox.store.queries import int_array, query
from outbox.store.schema import FLEET_SCHEMA
from outbox.store.sessions import Link

log = logging.getLogger("outbox.ordering")

HEARTBEAT_FRACTION = 5  # heartbeats per ownership lease
FORGET_EVERY = 60.0  # seconds between clean-ups of relays gone for a while


class Membership:
    """The relay's row in its database's membership; ``beat()`` from the relay loop."""

    def __init__(self, link: Link, *, name: str, lease: float, batch_lease: float) -> None:
        self.id = uuid.uuid4()  # the relay's id in its database and in each outbox it serves
        self.link = link
        self.name = name
        self.lease = lease
        self.batch_lease = batch_lease
        self.changed = False  # it joined or left an outbox since its last heartbeat
        self.beats = 0  # heartbeats that went through
        self._next = 0.0
        self._next_forget = 0.0
        self._others: str | None = None  # the digest of the other live members at the last heartbeat
        self._renewed = 0.0  # when a heartbeat last went through (monotonic)
        self.heartbeat = Condition(
            log, "membership", "membership heartbeat failing (every outbox's leases lapse if this lasts)"
        )

    @property
    def interval(self) -> float:
        return self.lease / HEARTBEAT_FRACTION

    @property
    def due_at(self) -> float:
        """When the next heartbeat is due (monotonic seconds)."""
        return self._next

    def beat(self, pids: Iterable[int], stale: list[tuple[int, dt.datetime]], readiness: str) -> bool:
        """Renew the membership (and with it every lease). ``pids``: the relay's sessions, shown by
        status; ``stale``: its lost sessions (pid, start), which may live on in the server with
        row locks: ended, and the list emptied once they are gone; ``readiness``: the kind of its
        /readyz state. Returns True when the other members changed, or this relay's lease ran out
        before it: look at every outbox. Never raises."""
        self._next = time.monotonic() + self.interval
        changed = self.changed
        try:
            row = self._beat(list(pids), stale, readiness, changed)
        except psycopg.Error as exc:
            self.heartbeat.fail(str(exc))
            if isinstance(exc, psycopg.OperationalError):
                self.link.lost()
            return False
        self.heartbeat.ok()
        self.beats += 1
        if changed:
            self.changed = False
        now = time.monotonic()
        # Its lease ran out before this heartbeat: others may have taken partitions of its since.
        lapsed = self._renewed > 0 and now - self._renewed > self.lease
        self._renewed = now
        moved = row != self._others
        self._others = row
        return moved or lapsed

    def _beat(
        self, pids: list[int], stale: list[tuple[int, dt.datetime]], readiness: str, changed: bool
    ) -> str:
        conn = self.link.get()
        lost = {
            "stale_pids": int_array(pid for pid, _ in stale),
            "stale_starts": [started for _, started in stale],
        }
        if stale:
            ended = conn.execute(query("end_stale_sessions", FLEET_SCHEMA), lost).fetchone()
            if ended is not None and ended[0]:
                log.info("ended %d of this relay's sessions lost in a network outage", ended[0])
        beat = {
            "me": self.id,
            "name": self.name,
            "ttl": self.lease,
            "lease": self.batch_lease,
            "pids": int_array(pids),
            "readiness": readiness,
            "changed": changed,
        }
        row = conn.execute(query("fleet_heartbeat", FLEET_SCHEMA), beat).fetchone()
        now = time.monotonic()
        if now >= self._next_forget:  # memberships gone for 10 minutes: a minute late is fine
            self._next_forget = now + FORGET_EVERY
            conn.execute(query("fleet_forget", FLEET_SCHEMA))
        if stale:
            alive = conn.execute(query("stale_sessions_alive", FLEET_SCHEMA), lost).fetchone()
            if alive is not None and not alive[0]:
                stale.clear()  # all gone: nothing of ours can hold a row lock any more
        return str(row[0]) if row is not None else ""

    def leave(self) -> None:
        """Clean shutdown (every outbox's partitions handed over already): leave at once."""
        try:
            self.link.get().execute(query("fleet_leave", FLEET_SCHEMA), {"me": self.id})
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):
                self.link.lost()
            log.warning("could not leave the membership, it lapses with the lease: %s", exc)
