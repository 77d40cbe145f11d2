"""One sink per route URL: the scheme picks the sink; a missing client names its extra.

The sink modules import their clients at import time, so they are imported here
only once :func:`require_clients` has checked that the extra is installed.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from outbox.extras import require
from outbox.sinks.base import Sink
from outbox.sinks.router import Router
from outbox.sinks.routes import SCHEMES, Route, SinkURL

if TYPE_CHECKING:
    from outbox.sinks.claim_check import Store


def require_clients(routes: list[Route]) -> None:
    """MissingExtra (one line naming ``outbox-relay[extra]``) for the first route whose client is absent."""
    for route in routes:
        extra = SCHEMES[route.url.scheme].extra
        if extra is not None:
            require(extra, f"route {route.display}")


def check_sinks(routes: list[Route], cloudevents_source: str | None = None) -> None:
    """ConfigError (one line, naming the route) for the first route its sink cannot use as it
    is (an AWS route without a region, EventBridge without a Source): at start, not at the
    first event. Sinks that check something have a ``check(url, source)`` class method."""
    for route in routes:
        module, name = SCHEMES[route.url.scheme].sink.split(":")
        check = getattr(getattr(importlib.import_module(module), name), "check", None)
        if check is not None:
            check(route.url, cloudevents_source)


@dataclass
class SinkMaker:
    """Makes the sink of a route URL. ``kafka`` makes the sink of ``kafka://`` routes
    (the built-in one, or a custom ``--sink`` factory)."""

    kafka: Callable[[str, dict[str, str], float], Sink]
    kafka_config: Mapping[str, str] = field(default_factory=dict)
    timeout: float = 15.0  # seconds a sink may take to confirm one event
    webhook_secrets: list[bytes] = field(default_factory=list)
    # (topic glob, secrets) for the webhook routes: a receiver's own secrets (first match wins)
    webhook_secrets_for: list[tuple[str, list[bytes]]] = field(default_factory=list)
    cloudevents_source: str | None = None  # set: CloudEvents attributes as headers (binary mode)
    claim_check: tuple[Store, int] | None = None  # (store, over): big payloads by reference

    def __call__(self, url: SinkURL) -> Sink:
        sink = self._make(url)
        if self.cloudevents_source is not None:
            from outbox.sinks.cloudevents import CloudEventsSink

            sink = CloudEventsSink(sink, url.scheme, self.cloudevents_source)
        if self.claim_check is not None:
            from outbox.sinks.claim_check import ClaimCheckSink

            sink = ClaimCheckSink(sink, *self.claim_check)
        return sink

    def _make(self, url: SinkURL) -> Sink:
        if url.scheme == "kafka":
            return self.kafka(url.kafka_bootstrap, dict(self.kafka_config), self.timeout)
        module, name = SCHEMES[url.scheme].sink.split(":")
        cls = getattr(importlib.import_module(module), name)
        if url.scheme in ("http", "https"):
            sink: Sink = cls(
                url, timeout=self.timeout, secrets=self.webhook_secrets, secrets_for=self.webhook_secrets_for
            )
        elif url.scheme == "eventbridge":  # its Source: ?source=, else the CloudEvents source
            sink = cls(url, timeout=self.timeout, source=self.cloudevents_source)
        else:
            sink = cls(url, timeout=self.timeout)
        return sink


def default_kafka(bootstrap: str, config: dict[str, str], timeout: float) -> Sink:
    from outbox.sinks.kafka import KafkaSink

    return KafkaSink(bootstrap, config, delivery_timeout=timeout)


def routed(
    routes: list[Route],
    delivery_timeout: float,
    *,
    kafka: Callable[[str, dict[str, str], float], Sink] = default_kafka,
    kafka_config: Mapping[str, str] | None = None,
    webhook_secrets: list[bytes] | None = None,
    cloudevents_source: str | None = None,
    claim_check: tuple[Store, int] | None = None,
    webhook_secrets_for: list[tuple[str, list[bytes]]] | None = None,
) -> Callable[[], Sink]:
    """The relay's sink factory for ``routes``: a Router over one sink per URL. The relay adds
    each outbox's key chains where its ordering needs them
    (:meth:`~outbox.relay.upkeep.sinks.SinkUpkeep.chain`).
    With ``cloudevents_source``, each sink adds the CloudEvents attributes
    (:mod:`outbox.sinks.cloudevents`); with ``claim_check`` (a store and a size), payloads over
    the size go to the store (:mod:`outbox.sinks.claim_check`)."""
    make = SinkMaker(
        kafka,
        dict(kafka_config or {}),
        delivery_timeout,
        list(webhook_secrets or []),
        list(webhook_secrets_for or []),
        cloudevents_source,
        claim_check,
    )

    def sink() -> Sink:
        # No key chains inside: the relay keeps a set per outbox, across the router's sinks
        # (one set shared by every outbox let one outbox's failure hold another's keys).
        return Router(routes, make)

    return sink
