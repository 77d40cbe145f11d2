"""Sinks that misbehave on purpose, for the fault suite (``--sink outbox_bench.faults.sinks:late_acks``)."""

from __future__ import annotations

import os
import time
from typing import Any

from outbox.events import ClaimedEvent
from outbox.sinks.base import Outcome, Report, SinkWrapper
from outbox.sinks.kafka import KafkaSink


class LateAcks(SinkWrapper):
    """The real Kafka sink, except that for a window its delivery reports come late.

    From ``after`` seconds after the first event it is given (the writers' start: on a loaded
    machine the app's first commit came 10 s after the relay's, when a window timed from the
    relay's start was over), for ``window`` seconds, every produced event's report is held for
    ``delay`` seconds. The messages reach the broker at
    once; only the worker's acknowledgement is slow. With ``delay`` longer than
    the batch lease this is a worker stalled past its lease (a GC pause, CPU
    starvation): its batch's session is ended by PostgreSQL, another relay
    delivers the events again, and the stale worker's ack must not count.
    """

    def __init__(self, inner: KafkaSink, after: float, window: float, delay: float) -> None:
        super().__init__(inner)
        self.after, self.length = after, window
        self.window: tuple[float, float] | None = None  # set by the first event
        self.delay = delay
        self._held: list[tuple[float, Report, Outcome]] = []

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        now = time.monotonic()
        if self.window is None:
            self.window = (now + self.after, now + self.after + self.length)
        if not self.window[0] <= now < self.window[1]:
            return self.inner.produce(event, report)
        release_at = now + self.delay

        def late(outcome: Outcome) -> None:
            self._held.append((release_at, report, outcome))

        return self.inner.produce(event, late)

    def poll(self, timeout: float) -> None:
        self.inner.poll(timeout)
        if self._held:
            now = time.monotonic()
            due = [h for h in self._held if h[0] <= now]
            self._held = [h for h in self._held if h[0] > now]
            for _, report, outcome in due:
                report(outcome)


def late_acks(bootstrap: str, config: dict[str, Any], delivery_timeout: float) -> LateAcks:
    """Window and delay from OUTBOX_FAULT_LATE_AFTER / _WINDOW / _DELAY (seconds)."""
    return LateAcks(
        KafkaSink(bootstrap, config, delivery_timeout=delivery_timeout),
        after=float(os.environ.get("OUTBOX_FAULT_LATE_AFTER", "2")),
        window=float(os.environ.get("OUTBOX_FAULT_LATE_WINDOW", "1")),
        delay=float(os.environ.get("OUTBOX_FAULT_LATE_DELAY", "10")),
    )
