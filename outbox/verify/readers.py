"""Which reader reads a route's sink back: the sinks that keep a log (Kafka, JetStream, Redis
Streams, Kinesis); None for those that keep none to read (SQS, SNS, EventBridge, RabbitMQ,
webhooks, Pub/Sub)."""

from __future__ import annotations

from outbox.extras import require
from outbox.sinks.routes import SinkURL
from outbox.verify.outcome import Reader


def reader_for(
    url: SinkURL, *, kafka_config: dict[str, str] | None = None, timeout: float = 10.0,
    compare_bodies: bool = True,
) -> Reader | None:  # fmt: skip
    """A reader of ``url``'s sink, or None when it keeps nothing to read back."""
    if url.scheme == "kafka":
        from outbox.verify.kafka import KafkaReader

        return KafkaReader(url.kafka_bootstrap, kafka_config, timeout=timeout, compare_bodies=compare_bodies)
    if url.scheme in ("redis", "rediss"):
        require("redis", "outbox verify of a redis:// route")
        from outbox.verify.redis import RedisReader

        return RedisReader(url, timeout=timeout, compare_bodies=compare_bodies)
    if url.scheme in ("nats", "tls"):
        require("nats", "outbox verify of a nats:// route")
        from outbox.verify.nats import NatsReader

        return NatsReader(url, timeout=timeout, compare_bodies=compare_bodies)
    if url.scheme == "kinesis":
        require("aws", "outbox verify of a kinesis:// route")
        from outbox.verify.kinesis import KinesisReader

        return KinesisReader(url, timeout=timeout, compare_bodies=compare_bodies)
    return None
