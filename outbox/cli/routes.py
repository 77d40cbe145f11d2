"""The options that say where events go: the routes (``--route GLOB=URL``) and Kafka's
settings; shared by ``outbox relay`` and ``outbox verify``, which reads the sinks back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from outbox.errors import ConfigError
from outbox.settings import setting


@dataclass
class KafkaOptions:
    kafka_bootstrap: str | None = setting(None, "Kafka bootstrap servers HOST:PORT[,...]")
    kafka_config: list[str] = setting(
        default_factory=list,
        help="librdkafka producer setting, repeatable, e.g. security.protocol=SASL_SSL "
        "(in the variable: a comma-separated KEY=VALUE list)",
        metavar="KEY=VALUE",
    )


@dataclass
class RouteOptions:
    route: list[str] = setting(
        default_factory=list,
        help="GLOB=URL: events whose topic matches GLOB (fnmatch, first match wins) go to the sink at "
        "URL: kafka://host:port[,...], amqp://user:pass@host:port/vhost?exchange=X, nats://host:port, "
        "redis://host:port/db?maxlen=N, http(s)://host/path/{topic}/{key}; repeatable (in the "
        "variable: separated by whitespace or newlines); --kafka-bootstrap B adds a last route "
        "*=kafka://B",
        env="OUTBOX_ROUTES",
        metavar="GLOB=URL",
    )


def parse_kafka_config(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (or comma-separated lists of them) as a dict."""
    config: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--kafka-config: expected KEY=VALUE, got {part.split('=')[0]!r}")
            config[key.strip()] = value.strip()
    return config
