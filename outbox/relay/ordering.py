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

A relay's leases in every outbox of a database are one row, its membership
(:mod:`outbox.store.membership`), renewed every ``lease / 5`` seconds on its own
autocommit connection. A look at an outbox (:meth:`Ordering.tick`) registers
the relay in it and moves it toward its fair share of partitions (computed
from the outbox's live relays in join order):

- too few: take free partitions, or those whose owner's lease expired;
- too many: mark the extras ``releasing`` (the claim query stops taking them)
  and hand them over once every batch that was in flight at that moment has
  finished, so the next owner can never find one of their rows still locked.

A look comes when the outbox joins, when the membership heartbeat finds that
the database's relays changed, every ``lease / 5`` while the outbox's shares
are not settled, and every ``SETTLED_LOOK`` seconds or so otherwise.

A lease that lapsed (a late heartbeat) while no other relay took the partition
is simply renewed: only the owner claims, and claims check the lease, so
nothing happened to it meanwhile.

Fencing after a crash or a stall: every ordered claim holds a shared advisory
lock on each partition it claims from, for its transaction (the batch's life).
A partition taken over is ``fenced`` until that lock is free: the previous
owner's batches have ended, however long they lived (a SIGKILL closes their
sessions at once; PostgreSQL ends a stalled, idle one at the batch lease; a
starved but live one ends when it finishes). Until then no one claims from it,
so a stale row lock can never make the new owner skip ahead of an undelivered
event. No time bound is assumed: a starved owner's finish() runs statements,
and each resets the idle timeout; a stopped one may leave the server blocked
writing a claim's rows to it, which no timeout ends. So, for liveness, the new
owner ends the sessions still holding the lock once its own batch lease has
passed since the takeover: ended, they can acknowledge nothing, and what they
sent before is an earlier duplicate of what the new owner sends. The claim
takes the lock, then checks the lease on the clock, so a relay whose lease
expired claims nothing even before it notices. A relay that lost sessions in a network outage ends them itself
(pid + start time, from :class:`~outbox.store.sessions.Sessions`), which frees
their locks without waiting out the batch lease.

Key holds
---------
Within one relay, a key whose event failed (a retry, or a dead letter that
parks) must not have its later events sent before that failure is committed:
from then on the claim query skips them (an earlier event of the key has
``attempts > 0`` or a parked dead letter). Until then — while the failing
batch is still in flight — the relay holds the key's events in memory:
leaves them pending, untouched, in every batch it sends. :class:`KeyHolds`
counts, per key, the in-flight batches that hold it.

An event held that way stays locked, untouched, in its batch until the batch
ends, and a claim skips locked rows: once nothing in the table blocks the key
(its failed event was retried and delivered meanwhile, or the failing batch
lost its lease and committed nothing), a claim would take the key's later
events and send them ahead of it. So until its batch ends, claims skip the
key's events after a held one (``KeyHolds.skip_after``). They are skipped, not
claimed and held: a claim that held them would lock them in turn, and batches
out one after another would pass that on for as long as they overlap. The
key's earlier events (the failed one, retried) are claimed and sent as usual.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Iterable
from typing import Any, NamedTuple

import psycopg

from outbox.observe.conditions import Condition
from outbox.store.membership import HEARTBEAT_FRACTION, Membership
from outbox.store.queries import int_array, query

log = logging.getLogger("outbox.ordering")

PARTITIONS = 64  # logical partitions, fixed by migration 0002
OWNERSHIP_LEASE = 10.0  # seconds; a dead relay's partitions are taken over within this + a heartbeat
FORGET_EVERY = 300.0  # seconds between clean-ups of an outbox's relays gone for a while
# Seconds between looks at an outbox whose shares are settled (jittered down to half): a relay
# of 1,000 outboxes makes about 11 a second. Changes are seen sooner, through the membership.
SETTLED_LOOK = 120.0
FENCE_RECHECK = 0.5  # seconds before a relay looks again at partitions it took fenced
ORDERINGS = ("key", "none")  # key: per-key order across relays; none: plain SKIP LOCKED
ON_DEAD = ("park", "continue")  # park: a dead letter holds back its key's later events


class Failure(NamedTuple):
    """An event that failed, to be retried: where it was in the relay's order of sending."""

    event_id: str
    batch: int  # its batch's number (Batch.seq: the order the relay made its batches in)
    place: int  # its index in that batch
    last_sent: int  # the last batch made when it failed: any of the key's events after it in
    # those were on their way already, and delivered they land ahead of the retry
    at: float  # monotonic


class KeyHolds:
    """Keys held back in memory, each counted by the in-flight batches that hold it; and the
    watch on their order (:meth:`failed`, :meth:`overtaken`)."""

    def __init__(self, horizon: float = 600.0) -> None:
        self.keys: dict[bytes, int] = {}  # key -> number of in-flight batches that hold it
        self._by_batch: dict[int, set[bytes]] = {}
        # key -> {in-flight batch: the lowest id of the key's events it holds locked, untouched}:
        # claims skip the key's events after that id (skip_after).
        self._skip: dict[bytes, dict[int, int]] = {}
        self._skipped_by_batch: dict[int, set[bytes]] = {}
        # key -> its first event that failed while later ones of the key were on their way.
        # Empty but for the batch lease after a failure (``horizon`` seconds): no batch sent
        # before a failure can still be in flight after that.
        self.failures: dict[bytes, Failure] = {}
        self._horizon = horizon
        self._looked = 0.0

    def failed(self, key: bytes, failure: Failure) -> None:
        """An event of ``key`` failed and will be retried: an event of the key sent after it and
        before the failure, delivered, has overtaken it (:meth:`overtaken`)."""
        self._forget(failure.at)
        known = self.failures.get(key)
        if known is None or failure.batch > known.last_sent:
            # None known, or the known one's window closed before this batch was made: nothing
            # sent after this failure can overtake that one, so this one is the key's watch.
            self.failures[key] = failure
        elif (failure.batch, failure.place) < (known.batch, known.place):
            self.failures[key] = failure._replace(last_sent=max(failure.last_sent, known.last_sent))
        elif failure.last_sent > known.last_sent:
            self.failures[key] = known._replace(last_sent=failure.last_sent, at=failure.at)

    def overtaken(self, key: bytes, batch: int, index: int) -> Failure | None:
        """The failed event of ``key`` that event ``index`` of batch ``batch``, delivered, went
        ahead of; None when it went in order."""
        known = self.failures.get(key)
        if known is None or batch > known.last_sent or (batch, index) <= (known.batch, known.place):
            return None
        return known

    def _forget(self, now: float) -> None:
        """Drop the failures older than the horizon (a look at most every tenth of it)."""
        if now - self._looked < self._horizon / 10:
            return
        self._looked = now
        for key in [k for k, f in self.failures.items() if now - f.at > self._horizon]:
            del self.failures[key]

    def add(self, batch: int, key: bytes, locked: int | None = None) -> None:
        """An event of ``key`` failed in batch ``batch``: hold the key until that batch ends.
        ``locked``: instead, batch ``batch`` holds the event of ``key`` with this id locked,
        untouched (held behind an earlier failure): until the batch ends, claims skip the key's
        events after it (the ones before it, the failed one retried, go as usual)."""
        if locked is not None:
            by_batch = self._skip.setdefault(key, {})
            by_batch[batch] = min(locked, by_batch.get(batch, locked))
            self._skipped_by_batch.setdefault(batch, set()).add(key)
            return
        held = self._by_batch.setdefault(batch, set())
        if key not in held:
            held.add(key)
            self.keys[key] = self.keys.get(key, 0) + 1

    def skip_after(self) -> tuple[list[bytes], list[int]]:
        """(keys, ids) for the claim: each key's events after its id are skipped."""
        keys = list(self._skip)
        return keys, [min(self._skip[k].values()) for k in keys]

    def release(self, batch: int) -> None:
        """Batch ``batch`` ended (its failures committed, or rolled back): drop its holds."""
        for key in self._by_batch.pop(batch, ()):
            n = self.keys[key] - 1
            if n:
                self.keys[key] = n
            else:
                del self.keys[key]
        for key in self._skipped_by_batch.pop(batch, ()):
            by_batch = self._skip[key]
            del by_batch[batch]
            if not by_batch:
                del self._skip[key]


class Ordering:
    """One relay's ordering: its partitions (``tick()`` from the relay loop) and its key holds."""

    def __init__(
        self,
        *,
        member: Membership,
        schema: str,
        name: str,
        lease: float,
        batch_lease: float,
        ordering: str,
        on_dead: str,
        outbox: str | None = None,
    ) -> None:
        self.member = member
        self.id: uuid.UUID = member.id
        self.name = name
        self.schema = schema
        self.lease = lease
        self.batch_lease = batch_lease
        self.ordering = ordering
        self.ordered = ordering == "key"
        # Does a dead letter hold back its key's later events (ordered mode, --on-dead park)?
        self.parks = self.ordered and on_dead == "park"
        self.holds = KeyHolds(horizon=max(lease, batch_lease))
        claim, limits = (
            ("claim_batch", "claim_limits_ordered")
            if self.ordered
            else ("claim_batch_unordered", "claim_limits")
        )
        # By (limited, skipping): a claim leaves out the clauses it does not need, so that
        # PostgreSQL runs a plan it cached, not one made for each claim (decision 0001).
        self._claims = {
            (limited, skipping): query(
                claim,
                schema,
                fragments={
                    "limits": limits if limited else None,
                    "skips": "claim_skips" if skipping else None,
                },
            )
            for limited in (False, True)
            for skipping in (False, True)
        }
        self.link = member.link  # the heartbeat's connection, shared with the database's other outboxes
        self._next = 0.0
        self._next_forget = 0.0
        self.looks = 0  # looks that went through
        self._settled_before = False  # a look found it settled before
        self.owned: set[int] = set()
        self.lost_partitions = 0  # partitions found taken by another relay (for metrics)
        # partition -> the in-flight batches (by id) that may hold its rows
        self._releasing: dict[int, set[int]] = {}
        # ``outbox``: the name of the outbox (a relay serving several), in its lines and log fields.
        said = f"outbox {outbox}: " if outbox not in (None, "default") else ""
        self._said = said  # the prefix of this outbox's log lines
        self.heartbeat = Condition(
            log,
            "heartbeat",
            f"{said}ownership check failing (its shares stay as they are)",
            fields={"outbox": outbox} if outbox is not None else None,
        )

    def claim(
        self, conn: psycopg.Connection[Any], limit: int, only: str | None = None, skip: str | None = None
    ) -> list[tuple[Any, ...]]:
        """Lock up to ``limit`` events this relay may deliver now, in id order (the batch's lease).
        ``only`` / ``skip``: regular expressions of the topics to claim only / to leave (limits:
        in ordered mode, a key's events after one left wait too)."""
        return self.send_claim(conn, limit, only, skip).fetchall()

    def send_claim(
        self, conn: psycopg.Connection[Any], limit: int, only: str | None = None, skip: str | None = None
    ) -> psycopg.Cursor[Any]:
        """The claim's statement, executed: its rows are the cursor's (in pipeline mode, once the
        pipeline is synced: several outboxes' claims in one round trip)."""
        # Binary results: the same Python types for these columns, without hex-decoding the
        # payloads or parsing numbers from text (decision 0001).
        cur = conn.cursor(binary=True)
        keys, ids = self.holds.skip_after()
        params = {
            "limit": limit,
            "owner": self.id,
            "skip_keys": keys,
            "skip_after": ids,
            "only": only,
            "skip": skip,
        }
        return cur.execute(self._claims[only is not None or skip is not None, bool(keys)], params)

    @property
    def interval(self) -> float:
        return self.lease / HEARTBEAT_FRACTION

    def delay_first_heartbeat(self, seconds: float) -> None:
        """The next look in ``seconds`` (a relay spreads its outboxes' looks)."""
        self._next = time.monotonic() + seconds

    def look_within(self, seconds: float) -> None:
        """The next look at a random point within ``seconds`` (the database's relays changed),
        unless one is due sooner."""
        self._next = min(self._next, time.monotonic() + random.uniform(0, seconds))

    @property
    def due_at(self) -> float:
        """When the next heartbeat is due (monotonic seconds)."""
        return self._next

    def tick(self, in_flight: Iterable[int]) -> bool:
        """A look at the outbox's ownership: registration, hand-overs, acquisitions. Never raises.

        ``in_flight``: the outbox's batches in flight (partitions being released wait for them).
        Returns True when partitions were acquired (there may be work at once).
        """
        self._next = time.monotonic() + self.interval
        try:
            acquired, settled = self._tick(set(in_flight))
        except psycopg.Error as exc:
            self.heartbeat.fail(str(exc))
            if isinstance(exc, psycopg.OperationalError):  # the connection; else this schema's own
                self.link.lost()
            return False
        self.heartbeat.ok()
        self.looks += 1
        if settled:
            # The look after the first settled one anywhere in the period, later ones in its
            # second half (every 60-120 s): a relay that started with a thousand outboxes looks at
            # them evenly, not in a wave (decision 0013).
            low = 0.5 if self._settled_before else 0.0
            self._settled_before = True
            self._next = time.monotonic() + SETTLED_LOOK * random.uniform(low, 1.0)
        return acquired

    def _tick(self, in_flight: set[int]) -> tuple[bool, bool]:
        """(acquired any, settled: its share owned, none being handed over or fenced)."""
        conn = self.link.get()
        s = self.schema
        beat = {
            "me": self.id,
            "name": self.name,
            "ttl": self.lease,
            "lease": self.batch_lease,
            "ordering": self.ordering,
        }
        # Registration and the outbox's ownership in one statement: one round trip, one transaction.
        row = conn.execute(query("lane_tick", s), beat).fetchone()
        now = time.monotonic()
        if now >= self._next_forget:  # rows of relays gone for 10 minutes: minutes late is fine
            self._next_forget = now + FORGET_EVERY * random.uniform(0.5, 1.0)
            conn.execute(query("forget_relays", s))
        if self.ordering != "key":
            return False, True
        assert row is not None  # an aggregate: always one row
        still, releasing_now, fenced, live = row
        owned = set(still)
        taken = self.owned - owned
        if taken:
            self.lost_partitions += len(taken)
            log.warning(
                "%slost ownership of partitions %s (taken over after the lease expired)",
                self._said,
                sorted(taken),
                extra={"event": "ownership.lost"},
            )
        self.owned = owned
        releasing = set(releasing_now)
        # Hand over the partitions whose in-flight batches have all finished.
        ready = [p for p in releasing if not (self._releasing.get(p, set()) & in_flight)]
        if ready:
            conn.execute(query("release_partitions", s), {"me": self.id, "parts": int_array(ready)})
            self.owned -= set(ready)
            for p in ready:
                self._releasing.pop(p, None)
            log.info("%shanded over partitions %s", self._said, sorted(ready))
        if fenced:  # only then: reading pg_locks is the dearest statement of a heartbeat
            self._next = min(self._next, time.monotonic() + FENCE_RECHECK)
            row = conn.execute(
                query("end_fencing_sessions", s), {"me": self.id, "grace": self.batch_lease}
            ).fetchone()
            if row is not None and row[0]:
                log.warning(
                    "%sended %d session(s) of a previous owner still holding partitions taken over %g s ago",
                    self._said,
                    row[0],
                    self.batch_lease,
                    extra={"event": "ownership.fenced"},
                )
            conn.execute(query("unfence_partitions", s), {"me": self.id})
        share = fair_share(PARTITIONS, live, self.id)
        keeping = self.owned - releasing
        got: list[Any] = []
        if len(keeping) > share:
            extra = sorted(keeping)[share:]
            conn.execute(query("mark_releasing", s), {"me": self.id, "parts": int_array(extra)})
            for p in extra:
                self._releasing[p] = set(in_flight)
            log.info("%sreleasing partitions %s to rebalance", self._said, extra)
            if not in_flight:  # no batch out can hold their rows: hand them over now, not a look later
                conn.execute(query("release_partitions", s), {"me": self.id, "parts": int_array(extra)})
                self.owned -= set(extra)
                for p in extra:
                    self._releasing.pop(p, None)
                log.info("%shanded over partitions %s", self._said, extra)
        elif len(self.owned) < share:
            got = conn.execute(
                query("acquire_partitions", s),
                {"me": self.id, "count": share - len(self.owned)},
            ).fetchall()
            if got:
                self.owned |= {r[0] for r in got}
                log.info("%sacquired partitions %s", self._said, sorted(r[0] for r in got))
                if any(r[1] for r in got):
                    # Taken fenced: look again at the next heartbeat, not a whole interval later.
                    self._next = min(self._next, time.monotonic() + FENCE_RECHECK)
        # Settled: nothing to look at again soon (a fence to lift, a hand-over, a share to take).
        taken_fenced = any(r[1] for r in got)
        settled = not fenced and not taken_fenced and not self._releasing and len(self.owned) == share
        return bool(got), settled

    def release_all(self) -> None:
        """Clean shutdown: hand everything over now (no batch is in flight any more)."""
        try:
            self.link.get().execute(query("release_all", self.schema), {"me": self.id})
            self.owned = set()
        except psycopg.Error as exc:
            if isinstance(exc, psycopg.OperationalError):  # the connection; else this schema's own
                self.link.lost()
            log.warning("%scould not release partitions, they lapse with the lease: %s", self._said, exc)


def fair_share(partitions: int, live: list[uuid.UUID], me: uuid.UUID) -> int:
    """How many partitions ``me`` should own among ``live`` relays (join order).

    Shares differ by at most one; the earliest relays take the remainder. A
    relay not (yet) in the list counts itself in last.
    """
    members = list(live) if me in live else [*live, me]
    n = len(members)
    base, extra = divmod(partitions, n)
    return base + (1 if members.index(me) < extra else 0)
