"""The tap for a ``--sink`` URL: which :class:`~outbox_bench.harness.sinktaps.SinkTap` reads it back."""

from __future__ import annotations

from outbox_bench.harness.sinktaps import HttpTap, NatsTap, RabbitTap, RedisTap, SinkTap

from outbox.errors import ConfigError
from outbox.sinks.routes import AWS_SCHEMES, parse_url


def tap_class(sink: str) -> type[SinkTap]:
    """The tap for ``--sink`` (a URL, or ``http``), its extra checked; ConfigError naming it if none."""
    from outbox.extras import require

    if sink == "http":
        require("http", "outbox bench faults --sink http")
        return HttpTap
    url = parse_url(sink, "--sink")
    taps: dict[str, tuple[type[SinkTap], str]] = {
        "amqp": (RabbitTap, "rabbitmq"),
        "nats": (NatsTap, "nats"),
        "redis": (RedisTap, "redis"),
    }
    if url.scheme in AWS_SCHEMES:
        require("aws", f"outbox bench faults --sink {url.scheme}://")
        if not url.options.get("endpoint"):
            raise ConfigError(
                f"{url.display!r} needs ?endpoint= (moto, LocalStack): the fault harness puts a "
                "proxy in front of it, which TLS to AWS itself does not allow, and both the harness "
                "and the bench create and delete queues, topics, buses and streams there"
            )
        from outbox_bench.harness.awstap import AwsTap

        return type(f"AwsTap_{url.scheme}", (AwsTap,), {"scheme": url.scheme})
    if url.scheme == "pubsub":
        require("gcp", "outbox bench --sinks pubsub://")
        from outbox_bench.harness.pubsubtap import PubSubTap

        return PubSubTap
    if url.scheme not in taps:
        raise ConfigError(
            "--sink: expected amqp://, nats://, redis://, sqs://, sns://, eventbridge://, kinesis:// "
            f"or http, got {url.display!r}"
        )
    cls, extra = taps[url.scheme]
    require(extra, f"outbox bench faults --sink {url.scheme}://")
    return cls


def open_tap(sink: str, topic: str) -> SinkTap:
    """The tap of one run on ``--sink``."""
    return tap_class(sink)(sink, topic)
