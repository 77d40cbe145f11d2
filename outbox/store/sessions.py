"""The relay's PostgreSQL sessions: how they are opened, pooled and given up.

Each in-flight batch holds one session (its open transaction is the batch's
lease), so the relay keeps a few connections: idle ones wait in a list, and a
new one is opened, with backoff, when none is free. Every session runs with

- ``idle_in_transaction_session_timeout = lease``: PostgreSQL itself ends the
  session of a worker that stalls with a batch, which is the fence;
- ``statement_timeout = lease``: no statement outlives the lease either;
- ``jit = off``: the claim is a millisecond OLTP statement, and JIT compilation
  (set off by the cost estimates of its guarded subplans) takes longer than it;
- ``enable_sort = off``: the claim must walk the primary key in id order. A backlog that
  autovacuum has counted (``reltuples``) but nobody has analyzed makes the planner expect a
  few hundred rows past the claim's filters, and a sequential scan + sort of the whole
  table looks cheaper, at many times the time (decision 0013). No statement of these
  sessions needs a sort.

Before them, ``search_path`` is pinned to ``pg_catalog, pg_temp`` (:mod:`outbox.store.pinning`): no
overload another role planted in ``"$user"`` or ``public`` is ever called with the relay's rights.

The settings are made with ``set_config`` once connected, not passed as the startup packet's
``options`` (PgBouncer refuses that parameter). Each session's server pid is read from the
server too: behind a pooler, the pid the client library knows is the pooler's.

A database outage is one :class:`~outbox.observe.conditions.Condition`: one line when
connecting starts failing, a summary a minute, one line when it works again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import psycopg
from tenacity import Retrying, retry_if_exception_type, stop_when_event_set, wait_exponential_jitter

from outbox.observe.conditions import Condition
from outbox.store.dsn import scrub, secrets_of
from outbox.store.queries import query

log = logging.getLogger("outbox.relay")

RECONNECT_WAIT_MAX = 5.0  # seconds, the longest wait between connection attempts
APPLICATION_NAME = "outbox-relay"


class Sessions:
    """Open, idle and lost connections of one relay."""

    def __init__(
        self,
        dsn: str,
        *,
        lease: float,
        stop: threading.Event,
        limit: int | None = None,
        unreachable: Callable[[], None] | None = None,
    ) -> None:
        self._dsn = dsn
        # Called on the loop's thread each time take() fails to reach the database and waits to
        # try again: what the loop holds that only the database can settle must be let go of.
        self._unreachable = unreachable
        self.limit = limit  # the most sessions open at once (the connection budget); None: no limit
        self._secrets = secrets_of(dsn)
        self._lease_ms = int(lease * 1000)
        self._stop = stop
        self._idle: list[psycopg.Connection[Any]] = []
        # connection -> (server pid, backend start) of every open session; lost ones move to
        # ``stale`` (pid + start identify a backend: pids are reused).
        self._started: weakref.WeakKeyDictionary[psycopg.Connection[Any], tuple[int, dt.datetime]] = (
            weakref.WeakKeyDictionary()
        )
        self.stale: list[tuple[int, dt.datetime]] = []
        self.database = Condition(log, "database", "cannot reach PostgreSQL")

    def clean(self, exc: BaseException | None) -> str:
        """An error's text on one line, with the DSN's password masked."""
        return " ".join(scrub(str(exc), self._secrets).split())

    def connect(self, *, pooled: bool = True) -> psycopg.Connection[Any]:
        """A new session with the relay's settings (raises on failure). ``pooled``: one of the
        pool's, counted toward its limit (not so the heartbeat's connection)."""
        conn = psycopg.connect(self._dsn, autocommit=False, application_name=APPLICATION_NAME)
        try:
            conn.execute(query("pin_search_path", "public"), prepare=False)  # outbox.pinning: first
            row = conn.execute(query("backend_start", "public"), {"lease_ms": str(self._lease_ms)}).fetchone()
            conn.commit()  # the settings hold for the session
        except psycopg.Error:
            conn.close()
            raise
        if row is not None and pooled:
            self._started[conn] = (row[0], row[1])
        return conn

    def pid(self, conn: psycopg.Connection[Any]) -> int | None:
        """The server pid of an open session (None for one this relay did not open)."""
        started = self._started.get(conn)
        return started[0] if started is not None else None

    @property
    def open(self) -> int:
        """Sessions open now, idle or in use."""
        return len(self._started)

    def available(self) -> bool:
        """Would take() find or open a session (within the limit)?"""
        return bool(self._idle) or self.limit is None or self.open < self.limit

    def take(self) -> psycopg.Connection[Any] | None:
        """A free session; None if the limit is reached, or if stopping while reconnecting."""
        while self._idle:
            idle = self._idle.pop()
            if not idle.closed:
                return idle
            self._forget(idle)
        if self.limit is not None and self.open >= self.limit:
            return None
        try:
            for attempt in Retrying(
                retry=retry_if_exception_type(psycopg.OperationalError),
                wait=wait_exponential_jitter(multiplier=0.1, max=RECONNECT_WAIT_MAX),
                stop=stop_when_event_set(self._stop),
                before_sleep=lambda rs: self._cannot_reach(rs.outcome.exception() if rs.outcome else None),
                reraise=True,
            ):
                with attempt:
                    return self.connect()
        except psycopg.OperationalError:
            pass  # stop was requested while reconnecting
        return None

    def _cannot_reach(self, exc: BaseException | None) -> None:
        self.database.fail(self.clean(exc))
        if self._unreachable is not None:
            self._unreachable()

    def give_back(self, conn: psycopg.Connection[Any]) -> None:
        """The one place a session returns to the idle list (a closed one is dropped)."""
        if not conn.closed:
            self._idle.append(conn)
        else:
            self._forget(conn)

    def end(self, conn: psycopg.Connection[Any]) -> None:
        """End a transaction that wrote nothing (a claim that found no rows, a read) and give the
        session back. A COMMIT, not a ROLLBACK: psycopg forgets the session's prepared statements
        at every rollback (and deallocates them in one more round trip), and an idle relay would
        plan each claim anew. One that cannot end is discarded."""
        self._end(conn, conn.commit)

    def roll_back(self, conn: psycopg.Connection[Any]) -> None:
        """End the session's transaction and give it back; one that cannot is discarded."""
        self._end(conn, conn.rollback)

    def _end(self, conn: psycopg.Connection[Any], how: Callable[[], None]) -> None:
        try:
            how()
        except psycopg.Error:
            self.discard(conn)
            return
        self.give_back(conn)

    def lost(self, conn: psycopg.Connection[Any], error: str) -> None:
        """A session failed while the database was needed: close it, count it toward the outage."""
        self.database.fail(error)
        self.discard(conn)

    def discard(self, conn: psycopg.Connection[Any]) -> None:
        """Close a session that cannot be used again (ended by the server, broken)."""
        with contextlib.suppress(psycopg.Error):
            conn.close()
        self._forget(conn)

    def _forget(self, conn: psycopg.Connection[Any]) -> None:
        """A closed session may live on in the server (its end never arrived: a blackhole),
        idle in a transaction with row locks: remember it until it is seen gone."""
        started = self._started.pop(conn, None)
        if started is not None:
            self.stale.append(started)

    def idle_pids(self) -> list[int]:
        return [pid for c in self._idle if not c.closed and (pid := self.pid(c)) is not None]

    def close_all(self) -> None:
        for conn in self._idle:
            with contextlib.suppress(psycopg.Error):
                conn.close()
            self._started.pop(conn, None)
        self._idle = []


class Link:
    """One autocommit connection, opened when first needed and again after it was lost: what the
    heartbeats of a database's outboxes share (used from the relay loop's thread only)."""

    def __init__(self, connect: Callable[[], psycopg.Connection[Any]]) -> None:
        self._connect = connect
        self._conn: psycopg.Connection[Any] | None = None

    def get(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = self._connect()
            self._conn.autocommit = True
        return self._conn

    def lost(self) -> None:
        """The connection failed: close it; the next get() opens another."""
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                self._conn.close()
            self._conn = None

    close = lost
