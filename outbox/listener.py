"""Wake-up on new events: LISTEN on its own autocommit connection.

NOTIFY is an optimisation only. The relay also polls on a jittered timer, so a
lost notification, a dropped listener connection, or NOTIFY switched off costs
latency, never correctness.
"""

from __future__ import annotations

import logging
import threading

import psycopg

from outbox.conditions import Condition
from outbox.dsn import scrub, secrets_of
from outbox.queries import query
from outbox.schema import channel_name

log = logging.getLogger("outbox.listener")

RECONNECT_DELAY = 1.0  # seconds between attempts to re-establish LISTEN
NOTIFY_WAIT = 0.5  # seconds; how often the listener checks for stop


class Listener(threading.Thread):
    """Sets ``wakeup`` whenever ``channel`` is notified, until ``stop`` is set."""

    def __init__(self, dsn: str, schema: str, wakeup: threading.Event, stop: threading.Event) -> None:
        super().__init__(name="outbox-listener", daemon=True)
        self._dsn = dsn
        self._schema = schema
        self._channel = channel_name(schema)
        self._wakeup = wakeup
        self._stop_event = stop
        self.condition = Condition(log, "listen", "LISTEN connection lost, polling only until it is back")

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, application_name="outbox-listener") as conn:
                    conn.execute(query("listen_events", self._schema, identifiers={"channel": self._channel}))
                    # Notifications sent while we were not listening are lost: look now.
                    self._wakeup.set()
                    self.condition.ok()
                    while not self._stop_event.is_set():
                        for _ in conn.notifies(timeout=NOTIFY_WAIT):
                            self._wakeup.set()
            except psycopg.Error as exc:
                if self._stop_event.is_set():
                    break
                self.condition.fail(scrub(str(exc), secrets_of(self._dsn)))
                self._stop_event.wait(RECONNECT_DELAY)
