"""Sinks: where the relay publishes events. Kafka first; others behind the same interface."""

from outbox.sinks.base import Dead, Delivered, Outcome, Retry, Sink, SinkWrapper

__all__ = ["Dead", "Delivered", "Outcome", "Retry", "Sink", "SinkWrapper"]
