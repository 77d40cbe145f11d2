"""Sink factories for tests, loaded by relay processes with ``--sink tests.sinks:NAME``."""

from __future__ import annotations

import os
import random
from typing import Any

from outbox.events import ClaimedEvent
from outbox.sinks.base import Outcome, Report, Retry, SinkWrapper
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


def flaky(bootstrap: str, config: dict[str, Any], delivery_timeout: float) -> FlakySink:
    """Failure rate from OUTBOX_TEST_FAILURE_RATE (default 0.02)."""
    rate = float(os.environ.get("OUTBOX_TEST_FAILURE_RATE", "0.02"))
    return FlakySink(KafkaSink(bootstrap, config, delivery_timeout=delivery_timeout), rate)
