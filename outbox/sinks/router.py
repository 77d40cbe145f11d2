"""The router: one sink per route, each event to the sink of the first route matching its topic.

An event whose topic matches no route is ``Dead("no_route", "no route for topic '<t>'")``
at once: parked like any keyed dead letter, so adding the route and redriving it delivers
it in order. Routes naming the same URL share one sink.

The router gives the relay what it asks of "the sink" as a whole: each topic's sink name
(the ``sink`` metric label), its span shape, which sinks are in trouble (``/readyz``), and
for the relay's per-outbox key chains (:class:`~outbox.sinks.chains.KeyChains`) where an
event goes and whether that sink keeps a key's in-flight order itself (Kafka). With a single
catch-all route the relay still goes through a :class:`Router`; its cost is one dict
lookup per event.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from outbox.events import TOPIC_OF, ClaimedEvent
from outbox.observe.tracing import kafka_shape
from outbox.sinks.base import (
    Dead,
    Named,
    Outcome,
    OutcomeSlots,
    Reachable,
    Report,
    Settle,
    Shaped,
    Signals,
    Sink,
    SinkWrapper,
    keeps_key_order,
    many_of,
    send_now,
)
from outbox.sinks.routes import Route, SinkURL, route_for

NO_ROUTE = "no_route"  # the error kind of an event no route takes
SLICE = 0.002  # seconds: how long a sink without a shared wake-up is polled at a time


def unwrap(sink: Sink) -> Any:
    """The innermost sink under any SinkWrapper layers."""
    while isinstance(sink, SinkWrapper):
        sink = sink.inner
    return sink


def sink_name(sink: Sink) -> str:
    """A sink's name for labels and logs: never holds credentials."""
    inner = unwrap(sink)
    return str(inner.name) if isinstance(inner, Named) else "custom"


def span_shape(sink: Sink, topic: str) -> tuple[str, dict[str, Any]]:
    """The span name and attributes for a batch of ``topic`` sent through ``sink``."""
    inner = unwrap(sink)
    return inner.span_shape(topic) if isinstance(inner, Shaped) else kafka_shape(topic)


class Router:
    """A sink that dispatches each event to its route's sink."""

    def __init__(self, routes: list[Route], make: Callable[[SinkURL], Sink]) -> None:
        self._routes = routes
        self._wake = threading.Event()  # shared by the sinks that signal their reports
        by_url: dict[str, Sink] = {}
        for route in routes:
            if route.url.text in by_url:
                continue
            sink = make(route.url)
            inner = unwrap(sink)
            if isinstance(inner, Signals):
                inner.wake = self._wake
            by_url[route.url.text] = sink
        self._sink_of_url = by_url
        self.sinks = list(by_url.values())
        self._signalled = [
            s for s in self.sinks if isinstance(inner := unwrap(s), Signals) and inner.wake is self._wake
        ]
        self._others = [s for s in self.sinks if s not in self._signalled]
        if not self._others:  # it signals (Signals) only when every sink of it does
            self.wake = self._wake
        self._by_topic: dict[str, Sink | None] = {}  # topic -> its sink, learnt on first sight
        # id(sink) -> whether it keeps the order of a key's events in flight (Kafka), for key chains
        self._keeps = {id(s): keeps_key_order(unwrap(s)) for s in self.sinks}

    def sink_for(self, topic: str) -> Sink | None:
        try:
            return self._by_topic[topic]
        except KeyError:
            route = route_for(self._routes, topic)
            sink = self._by_topic[topic] = None if route is None else self._sink_of_url[route.url.text]
            return sink

    @property
    def keeps_key_order(self) -> bool:
        """One sink that keeps a key's in-flight order itself: the relay needs no key chains."""
        return len(self.sinks) == 1 and self._keeps[id(self.sinks[0])]

    def destination(self, event: ClaimedEvent) -> tuple[object, bool]:
        """Where ``event`` goes, for a key chain across sinks (:class:`KeyChains` ``route``):
        its sink, and whether that sink keeps the order of a key's events in flight."""
        sink = self.sink_for(event.topic)
        return sink, sink is not None and self._keeps[id(sink)]

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        sink = self.sink_for(event.topic)
        if sink is None:
            return Dead(NO_ROUTE, f"no route for topic {event.topic!r}")
        return sink.produce(event, report)

    def produce_many(self, events: Sequence[ClaimedEvent], outcomes: OutcomeSlots, settle: Settle) -> int:
        """Hand the batch whole to its sink when every topic in it routes to one sink that takes
        batches (Kafka); returns how many events it queued (0: the caller goes event by event)."""
        sinks = {id(s): s for s in map(self.sink_for, set(map(TOPIC_OF, events)))}
        if len(sinks) != 1:
            return 0
        sink = next(iter(sinks.values()))
        many = many_of(sink)
        return 0 if many is None else many.produce_many(events, outcomes, settle)

    def poll(self, timeout: float) -> int:
        if len(self.sinks) == 1:  # the common deployment: one sink, which waits by itself
            return self.sinks[0].poll(timeout) or 0
        deadline = time.monotonic() + timeout
        while True:
            self._wake.clear()  # first: a report queued while the sinks are polled sets it again
            served = sum(sink.poll(0) or 0 for sink in self.sinks)
            left = deadline - time.monotonic()
            if served or left <= 0:
                return served
            if self._others:  # a sink that serves its reports only inside poll (Kafka)
                self._others[0].poll(min(left, SLICE))
            else:  # every sink signals the shared wake-up
                self._wake.wait(left)

    def send_now(self) -> None:
        for sink in self.sinks:
            send_now(sink)

    def flush(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        return sum(sink.flush(max(0.0, deadline - time.monotonic())) for sink in self.sinks)

    def healthy(self) -> bool:
        return all(sink.healthy() for sink in self.sinks)

    def name_of(self, topic: str) -> str:
        sink = self.sink_for(topic)
        return "none" if sink is None else sink_name(sink)

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]:
        sink = self.sink_for(topic)
        if sink is None:
            return f"send {topic}", {"messaging.destination.name": topic}
        return span_shape(sink, topic)

    def close(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for sink in self.sinks:
            sink.close(max(0.0, deadline - time.monotonic()))


# What the relay asks of its sink, whether a Router or a single (custom) sink.


def name_of(sink: Sink, topic: str) -> str:
    return sink.name_of(topic) if isinstance(sink, Router) else sink_name(sink)


def shape_of(sink: Sink, topic: str) -> tuple[str, dict[str, Any]]:
    return sink.span_shape(topic) if isinstance(sink, Router) else span_shape(sink, topic)


def sinks_of(sink: Sink) -> list[Sink]:
    """The sinks behind ``sink``: a Router's, or itself."""
    return list(sink.sinks) if isinstance(sink, Router) else [sink]


def health(sink: Sink) -> list[tuple[str, str | None]]:
    """(name, why it is down now or None) of each sink behind ``sink`` (a Router's, or itself)."""
    out = []
    for each in sink.sinks if isinstance(sink, Router) else [sink]:
        inner = unwrap(each)
        out.append((sink_name(each), inner.trouble() if isinstance(inner, Reachable) else None))
    return out


def states_of(sink: Sink) -> tuple[list[str], list[str]]:
    """(``<sink>: <why>`` per sink in trouble, ``<sink> ok|down: <why>`` per sink) for /readyz."""
    pairs = health(sink)
    return [f"{n}: {why}" for n, why in pairs if why], [
        f"{n} down: {why}" if why else f"{n} ok" for n, why in pairs
    ]
