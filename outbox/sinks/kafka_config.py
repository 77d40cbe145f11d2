"""The Kafka producer's configuration: the relay's defaults, what a user may override, and what
the guarantees require (idempotence, ``acks=all``, no gaps, no timeout of librdkafka's own)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from outbox.errors import ConfigError

# Settings the relay's guarantees depend on; a user may not weaken them. Gapless: an error that
# would leave a gap in a partition's messages is fatal (the producer is replaced), not skipped.
REQUIRED_CONFIG = {"enable.idempotence": "true", "acks": "all", "enable.gapless.guarantee": "true"}
# librdkafka never times a message out (0: never): the sink's deadline does (KafkaSink.healthy).
TIMEOUT_KEYS = ("message.timeout.ms", "delivery.timeout.ms")

DEFAULT_CONFIG: dict[str, Any] = {
    # Milliseconds a partition's messages wait to be sent together. Only under a backlog: after
    # a batch that was not full the relay calls send_now(), which skips the wait.
    "linger.ms": 5,
    "batch.num.messages": 10000,
    "queue.buffering.max.messages": 500000,
    "queue.buffering.max.kbytes": 1048576,
    # A silent broker (a blackhole, a half-open connection) is an error in 10 s, not 60:
    # librdkafka then reports the broker down and the relay's readiness follows.
    "socket.timeout.ms": 10000,
    "socket.keepalive.enable": True,
    "socket.connection.setup.timeout.ms": 10000,
}

# Secret-bearing librdkafka settings: never logged.
SECRET_KEYS = frozenset(
    {
        "sasl.password",
        "sasl.oauthbearer.client.secret",
        "ssl.key.password",
        "ssl.keystore.password",
        "ssl.key.pem",
        "ssl_key",
    }
)


def build_config(
    bootstrap: str, overrides: Mapping[str, Any] | None, delivery_timeout: float
) -> dict[str, Any]:
    """Producer configuration: defaults < user overrides < what the guarantees require."""
    config: dict[str, Any] = dict(DEFAULT_CONFIG)
    config.update(overrides or {})
    for key in TIMEOUT_KEYS:
        if key in config and str(config[key]) != "0":
            raise ConfigError(
                f"kafka config {key}: must be 0 (never); the relay times deliveries out itself "
                f"(OUTBOX_DELIVERY_TIMEOUT, {delivery_timeout:g} s), in order; got {config[key]!r}"
            )
        config.pop(key, None)
    config["message.timeout.ms"] = 0
    for key, required in REQUIRED_CONFIG.items():
        value = str(config.get(key, required)).lower()
        if value != required:
            raise ConfigError(
                f"kafka config {key}: must be {required!r} for at-least-once, "
                f"ordered delivery; got {config[key]!r}"
            )
        config[key] = required
    config["bootstrap.servers"] = bootstrap
    return config


def redacted(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with secret values masked, for logs."""
    return {k: ("***" if k in SECRET_KEYS or "password" in k else v) for k, v in config.items()}
