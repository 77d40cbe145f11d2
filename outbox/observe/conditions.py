"""Problems that start, last and end, logged so that an outage stays readable.

A relay left running while its database or broker is down would otherwise
write a line per failed attempt: thousands in minutes, the first and the last
(the ones an operator needs) lost among them. A :class:`Condition` writes

- one line when the problem starts, naming it and the error;
- while it lasts, at most one summary per ``SUMMARY_EVERY`` seconds, with the
  number of failed attempts and the last error;
- one line when it ends, with how long it lasted.

A problem that comes and goes (a sink failing one event in four, batch after batch) would
still write a start and an end line per batch: a condition made with ``settle`` ends only
once nothing failed for that many seconds, so it stays one episode while it flaps.

Every line carries a structured ``event`` (``<name>.started`` / ``.ongoing``
/ ``.ended``) so that tools count outages without parsing the wording.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

SUMMARY_EVERY = 60.0  # seconds between "still failing" lines while a condition lasts


class Condition:
    """One named problem of one component (e.g. ``database`` of the relay). Thread safe."""

    def __init__(
        self,
        log: logging.Logger,
        name: str,
        description: str,
        *,
        summary_every: float = SUMMARY_EVERY,
        clock: Callable[[], float] = time.monotonic,
        fields: dict[str, str] | None = None,
        settle: float = 0.0,
    ) -> None:
        self.log = log
        self.fields = dict(fields or {})  # structured fields of every line (e.g. the outbox's name)
        self.name = name  # short and stable: the structured event's prefix and a metric label
        self.description = description  # what an operator reads, e.g. "cannot reach PostgreSQL"
        self.summary_every = summary_every
        self.settle = settle  # seconds without a failure before an episode ends
        self._clock = clock
        self._lock = threading.Lock()
        self.since: float | None = None  # clock time the current episode started
        self.attempts = 0  # failed attempts in the current episode
        self.last_error = ""
        self.episodes = 0  # episodes so far (for metrics)
        self._summary_at = 0.0
        self._failed_at = 0.0  # clock time of the episode's last failure

    @property
    def active(self) -> bool:
        return self.since is not None

    def seconds(self) -> float:
        """How long the current episode has lasted (0 when none is)."""
        since = self.since
        return 0.0 if since is None else self._clock() - since

    def fail(self, error: str, *, said: bool = False) -> None:
        """One more failed attempt: logs only when the episode starts, and at summaries.
        ``said``: the caller has just logged this failure in a line of its own (with more than
        this line would say): an episode it starts begins without a second line."""
        error = " ".join(error.split())  # one line, whatever the driver put in the message
        with self._lock:
            now = self._clock()
            self.last_error = error
            self._failed_at = now
            if self.since is None:
                self.since = self._summary_at = now
                self.attempts = 1
                self.episodes += 1
                if not said:
                    started = {**self.fields, "event": f"{self.name}.started"}
                    self.log.warning("%s: %s", self.description, error, extra=started)
                return
            self.attempts += 1
            if now - self._summary_at >= self.summary_every:
                self._summary_at = now
                self.log.warning(
                    "%s: still failing after %.0f s, %d attempts, last: %s",
                    self.description,
                    now - self.since,
                    self.attempts,
                    error,
                    extra={**self.fields, "event": f"{self.name}.ongoing"},
                )

    def ok(self) -> None:
        """The thing worked: ends the episode (one line) if one was under way."""
        if self.since is None:  # the common case, without taking the lock
            return
        with self._lock:
            if self.since is None:
                return
            now = self._clock()
            if now - self._failed_at < self.settle:  # it may come back: the episode goes on
                return
            lasted = now - self.since
            self.log.warning(
                "%s: recovered after %.1f s (%d failed attempts, last: %s)",
                self.description,
                lasted,
                self.attempts,
                self.last_error,
                extra={**self.fields, "event": f"{self.name}.ended"},
            )
            self.since = None
            self.attempts = 0
