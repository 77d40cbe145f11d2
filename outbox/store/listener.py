"""Wake-up on new events: LISTEN on its own autocommit connection, one per database.

NOTIFY is an optimisation only. The relay also polls on a jittered timer, so a
lost notification, a dropped listener connection, or NOTIFY switched off costs
latency, never correctness.

A relay serving many outboxes of a database listens on all their channels (one per schema)
on this one connection: an outbox joins with :meth:`Listener.watch` and leaves with
:meth:`Listener.unwatch`, and the thread brings the connection's LISTENs up to date between
two waits.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import psycopg

from outbox.observe.conditions import Condition
from outbox.store import pinning
from outbox.store.dsn import scrub, secrets_of
from outbox.store.queries import query

log = logging.getLogger("outbox.listener")

RECONNECT_DELAY = 1.0  # seconds between attempts to re-establish LISTEN
NOTIFY_WAIT = 0.5  # seconds; how often the listener checks for stop and for channels to (un)listen


class Listener(threading.Thread):
    """Calls a channel's callback whenever it is notified, until ``stop`` is set."""

    def __init__(self, dsn: str, stop: threading.Event) -> None:
        super().__init__(name="outbox-listener", daemon=True)
        self._dsn = dsn
        self._stop_event = stop
        self._lock = threading.Lock()
        self._watched: dict[str, Callable[[], None]] = {}  # channel -> its callback
        self.condition = Condition(log, "listen", "LISTEN connection lost, polling only until it is back")

    def watch(self, channel: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from this thread) on each NOTIFY of ``channel``, from the next wait on."""
        with self._lock:
            self._watched[channel] = callback

    def unwatch(self, channel: str) -> None:
        with self._lock:
            self._watched.pop(channel, None)

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                with pinning.connect(self._dsn, autocommit=True, application_name="outbox-listener") as conn:
                    listening: set[str] = set()
                    first = True
                    while not self._stop_event.is_set():
                        with self._lock:
                            watched = dict(self._watched)
                        for channel in watched.keys() - listening:
                            conn.execute(query("listen_events", "public", identifiers={"channel": channel}))
                            # Notifications sent before we listened are lost: look now.
                            watched[channel]()
                        for channel in listening - watched.keys():
                            conn.execute(query("unlisten_events", "public", identifiers={"channel": channel}))
                        listening = set(watched)
                        if first:
                            self.condition.ok()
                            first = False
                        for note in conn.notifies(timeout=NOTIFY_WAIT):
                            callback = watched.get(note.channel)
                            if callback is not None:
                                callback()
            except psycopg.Error as exc:
                if self._stop_event.is_set():
                    break
                self.condition.fail(scrub(str(exc), secrets_of(self._dsn)))
                self._stop_event.wait(RECONNECT_DELAY)
