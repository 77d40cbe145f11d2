"""Sink factories for tests, loaded by relay processes with ``--sink tests.sinks:NAME``."""

from __future__ import annotations

import os
import random
from typing import Any

from outbox.events import ClaimedEvent
from outbox.sinks.base import Delivered, Outcome, Report, Retry, Sink, SinkWrapper
from outbox.sinks.kafka import KafkaSink


class FlakySink(SinkWrapper):
    """The real Kafka sink; a share of produce() calls fail as if the client refused them."""

    def __init__(self, inner: KafkaSink, failure_rate: float, seed: int | None = None) -> None:
        super().__init__(inner)
        self.rng = random.Random(seed)
        self.failure_rate = failure_rate
        self.failures = 0

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        if self.rng.random() < self.failure_rate:
            self.failures += 1
            return Retry("injected", "injected transient failure")
        return self.inner.produce(event, report)


class AnyFlakySink(SinkWrapper):
    """Any sink with injected failures, a third each: refused before sending (answered at once);
    for sinks the relay chains per key, also not sent but answered later, at the next poll (a
    nack, a return, a timeout: the hazard per-key chains exist for), and sent but answered
    failed (a lost confirmation: the sink has it, the relay retries it, a duplicate follows)."""

    def __init__(self, inner: Sink, failure_rate: float) -> None:
        super().__init__(inner)
        self.rng = random.Random()
        self.failure_rate = failure_rate
        self.late = not getattr(inner, "keeps_key_order", True)
        self.deferred: list[Report] = []

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        draw = self.rng.random() / self.failure_rate
        if draw >= 1:
            return self.inner.produce(event, report)
        if not self.late or draw < 1 / 3:
            return Retry("injected", "injected transient failure")
        if draw < 2 / 3:
            self.deferred.append(report)
            return None

        def lost(outcome: Outcome) -> None:
            report(Retry("injected", "injected lost confirmation") if type(outcome) is Delivered else outcome)

        return self.inner.produce(event, lost)

    def poll(self, timeout: float) -> int | None:
        deferred, self.deferred = self.deferred, []
        for report in deferred:
            report(Retry("injected", "injected failure reported late"))
        served = self.inner.poll(0 if deferred else timeout) or 0
        return served + len(deferred)

    def flush(self, timeout: float) -> int:
        self.poll(0)
        return self.inner.flush(timeout)


def flaky(bootstrap: str, config: dict[str, Any], delivery_timeout: float) -> FlakySink:
    """Failure rate from OUTBOX_TEST_FAILURE_RATE (default 0.02)."""
    rate = float(os.environ.get("OUTBOX_TEST_FAILURE_RATE", "0.02"))
    return FlakySink(KafkaSink(bootstrap, config, delivery_timeout=delivery_timeout), rate)
