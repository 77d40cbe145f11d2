"""A chore's statement on a session of the relay's pool: what every upkeep service does with the
database, with its failures said once (the session lost, or this outbox's own trouble)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from outbox.relay.lanes import Lane
from outbox.store.sessions import Sessions

T = TypeVar("T")
LaneError = Callable[[Lane, psycopg.Connection[Any], str], None]  # the outbox rests, said once


class Chores:
    """Runs a chore on a pool session, committed, and gives the session back."""

    def __init__(self, sessions: Sessions, lane_error: LaneError) -> None:
        self.sessions = sessions
        self._lane_error = lane_error

    def on_session(self, lane: Lane, what: str, work: Callable[[psycopg.Connection[Any]], T]) -> T | None:
        """``work`` on a session of the pool, committed; its result, or None when no session was
        free or it failed (said once: the session lost, or this outbox's own trouble)."""
        sessions = self.sessions
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
            self._lane_error(lane, conn, f"{what} failed: {sessions.clean(exc)}")
            return None
        sessions.give_back(conn)
        return result
