"""Limits per destination (``--limit GLOB=SPEC``) and shares per outbox (``--weight GLOB=N``).

A limit caps what the relays send to the topics its glob matches (as routes match: fnmatch,
case-sensitive; the first limit that matches a topic is its limit), per outbox:

- ``N/s``: a rate, a token bucket (a second's worth of burst, at least one event), taken from a
  tenth of a second's worth at a time;
- ``in_flight=N``: events sent and not yet answered, at most.

Both are shared by every relay process serving the outbox: the bucket and each relay's events
in flight are rows of the database's ``outbox_fleet`` schema (migration 0018), and a relay
takes tokens with one statement (:func:`take`) before it claims. A limited route's backlog
waits in the table: the relay claims a limited topic's events only as many as it may send now,
in a batch of their own, and its other claims leave them (and, in key order, every later event
of their keys) where they are, so they never fill a batch with events that cannot be sent.

A weight gives an outbox (its name matched by the glob) a share of the relay's claims while
several outboxes have a backlog: claims go to the outbox that has had the fewest events for its
weight (weight 1 unless a glob matches; the first matching glob wins).
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

import psycopg

from outbox.errors import ConfigError
from outbox.store.queries import glob_regex, query
from outbox.store.schema import FLEET_SCHEMA
from outbox.store.sessions import Link

# A bucket holds this many seconds of its rate (at least one event): less loses the tokens that
# come while a loaded machine's relays are late to take them (decision 0013), and a second's
# worth is what a rate per second allows anyway.
BURST_SECONDS = 1.0
GRANT_SECONDS = 0.1  # ... and is taken from this many seconds' worth at a time: a batch, not an event
_RATE = re.compile(r"^(\d+(?:\.\d+)?)/s$")
_IN_FLIGHT = re.compile(r"^in_flight=(\d+)$")


@dataclass(frozen=True)
class Limit:
    """One ``--limit GLOB=SPEC``."""

    glob: str
    rate: float | None  # events a second
    in_flight: int | None  # events in flight at once

    @property
    def burst(self) -> float:
        return max(1.0, (self.rate or 0.0) * BURST_SECONDS)

    @property
    def least(self) -> int:
        """Events a take waits for the bucket to hold (fewer when fewer are wanted)."""
        return max(1, int((self.rate or 0.0) * GRANT_SECONDS))

    @property
    def spec(self) -> str:
        parts = ([f"{self.rate:g}/s"] if self.rate is not None else []) + (
            [f"in_flight={self.in_flight}"] if self.in_flight is not None else []
        )
        return ",".join(parts)

    @property
    def display(self) -> str:
        return f"{self.glob}={self.spec}"

    def matches(self, topic: str) -> bool:
        return fnmatchcase(topic, self.glob)


def parse_limit(text: str) -> Limit:
    glob, sep, spec = text.partition("=")
    shown = f"--limit {text!r}"
    if not sep or not glob.strip() or not spec.strip():
        raise ConfigError(f"{shown}: expected GLOB=SPEC, e.g. 'partner.*=50/s,in_flight=8'")
    rate: float | None = None
    in_flight: int | None = None
    for part in spec.split(","):
        part = part.strip()
        if (m := _RATE.match(part)) and rate is None:
            rate = float(m.group(1))
            if not rate > 0:
                raise ConfigError(f"{shown}: the rate must be more than 0/s")
        elif (m := _IN_FLIGHT.match(part)) and in_flight is None:
            in_flight = int(m.group(1))
            if in_flight < 1:
                raise ConfigError(f"{shown}: in_flight must be at least 1")
        else:
            raise ConfigError(
                f"{shown}: {part!r} is not N/s (a rate) or in_flight=N (a cap), each at most once"
            )
    return Limit(glob.strip(), rate, in_flight)


def parse_limits(items: list[str]) -> list[Limit]:
    """Limits from ``--limit`` values (each may hold several, separated by whitespace)."""
    limits = [parse_limit(text) for item in items for text in item.split()]
    globs = [limit.glob for limit in limits]
    for glob in globs:
        if globs.count(glob) > 1:
            raise ConfigError(f"--limit {glob}=...: given twice")
    return limits


def parse_weights(items: list[str]) -> list[tuple[str, int]]:
    """``GLOB=N`` pairs from ``--weight`` values (each may hold several, whitespace-separated)."""
    out = []
    for text in (t for item in items for t in item.split()):
        glob, sep, n = text.partition("=")
        if not sep or not glob.strip() or not n.strip().isdigit() or int(n) < 1:
            raise ConfigError(
                f"--weight {text!r}: expected GLOB=N with N a whole number >= 1, e.g. 'gold-*=3'"
            )
        out.append((glob.strip(), int(n)))
    return out


def weight_of(weights: list[tuple[str, int]], outbox: str) -> int:
    """The outbox's weight: the first glob matching its name, else 1."""
    return next((n for glob, n in weights if fnmatchcase(outbox, glob)), 1)


def either(globs: list[str]) -> str | None:
    """One regular expression matching any of ``globs`` (None: none)."""
    return "|".join(glob_regex(g) for g in globs) if globs else None


@dataclass(eq=False)
class Gate:
    """One limit in one outbox of a relay: when to claim its events next, and what it has out."""

    limit: Limit
    only: str  # the topics it claims (its glob's, not an earlier limit's)
    skip: str | None
    pending: bool = True  # may have events waiting (woken, polled, or its last claim was full)
    next_try: float = 0.0  # monotonic: the soonest its next tokens may be taken
    flying: int = 0  # events of it in flight from this relay
    batches: int = 0  # its batches in flight from this relay
    reported: int = 0  # ``flying`` as last written to the database (in_flight caps)
    throttled_since: float = 0.0  # monotonic: since when its events wait for tokens (0: they do not)
    counted_at: float = 0.0  # monotonic: the throttled time is counted up to here

    def due(self, now: float) -> bool:
        return self.pending and now >= self.next_try

    def throttle(self, now: float, until: float) -> float:
        """No tokens now: try again at ``until``. Returns the seconds throttled since last counted."""
        self.next_try = until
        if not self.throttled_since:
            self.throttled_since = self.counted_at = now
            return 0.0
        counted, self.counted_at = now - self.counted_at, now
        return counted

    def flowing(self, now: float) -> float:
        """Tokens came: the throttled time ends. Returns the seconds throttled since last counted."""
        if not self.throttled_since:
            return 0.0
        counted, self.throttled_since = now - self.counted_at, 0.0
        return counted


def gates(limits: list[Limit]) -> list[Gate]:
    """A gate per limit; a topic belongs to the first limit whose glob matches it."""
    out = []
    for k, limit in enumerate(limits):
        out.append(Gate(limit, glob_regex(limit.glob), either([lim.glob for lim in limits[:k]])))
    return out


def take(conn: psycopg.Connection[Any], me: Any, schema: str, gate: Gate, want: int) -> tuple[int, float]:
    """Tokens for up to ``want`` events of ``gate``'s limit in outbox ``schema``, taken from the
    bucket every relay of the outbox shares, within its in-flight cap; (granted, seconds until
    a token is due when none was granted)."""
    limit = gate.limit
    row = conn.execute(
        query("limit_take", FLEET_SCHEMA),
        {
            "outbox": schema,
            "glob": limit.glob,
            "rate": limit.rate,
            "burst": limit.burst,
            "least": limit.least,
            "cap": limit.in_flight,
            "want": want,
            "me": me,
            "flying": gate.flying,
            "spec": limit.spec,
            "pattern": gate.only,
        },
    ).fetchone()
    assert row is not None
    granted, wait = int(row[0]), float(row[1] or 0.0)
    gate.reported = gate.flying + granted
    return granted, wait if not math.isnan(wait) else 0.0


def report(link: Link, me: Any, schema: str, gate: Gate, taking: int = 0, back: int = 0) -> None:
    """This relay's events in flight of the gate's limit, as they are now (plus ``taking``, about
    to be), when it is capped; and ``back``, tokens it took and could not use (none of its
    events could be claimed), into the bucket again for the outbox's other relays. Never raises:
    the next tokens taken write its events in flight again."""
    limit = gate.limit
    try:
        link.get().execute(
            query("limit_report", FLEET_SCHEMA),
            {
                "outbox": schema,
                "glob": limit.glob,
                "me": me,
                "flying": gate.flying + taking,
                "capped": limit.in_flight is not None,
                "back": back if limit.rate is not None else 0,
                "burst": limit.burst,
            },
        )
    except psycopg.Error as exc:
        if isinstance(exc, psycopg.OperationalError):
            link.lost()
        return
    gate.reported = gate.flying + taking


def finished(link: Link, me: Any, schema: str, gate: Gate, events: int) -> None:
    """A batch of ``events`` of the gate's limit left the loop: fewer in flight (written for the
    other relays when it is capped and nothing of it is being claimed, else with the next tokens)."""
    gate.flying -= events
    gate.batches -= 1
    if gate.limit.in_flight is not None:
        gate.next_try = min(gate.next_try, time.monotonic())  # room again
        if not gate.pending:
            report(link, me, schema, gate)
