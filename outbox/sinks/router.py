"""The router: one sink per route, each event to the sink of the first route matching its topic.

An event whose topic matches no route is ``Dead("no_route", "no route for topic '<t>'")``
at once: parked like any keyed dead letter, so adding the route and redriving it delivers
it in order. Routes naming the same URL share one sink. With a single catch-all route the
relay uses that sink directly (:func:`build`), so routing costs nothing in the common case.
"""

from __future__ import annotations

from collections.abc import Callable

from outbox.events import ClaimedEvent
from outbox.routes import Route, SinkURL, route_for
from outbox.sinks.base import Dead, Outcome, Report, Sink

NO_ROUTE = "no_route"  # the error kind of an event no route takes


class Router:
    """A sink that dispatches each event to its route's sink."""

    def __init__(self, routes: list[Route], make: Callable[[SinkURL], Sink]) -> None:
        self._routes = routes
        by_url: dict[str, Sink] = {}
        for route in routes:
            if route.url.text not in by_url:
                by_url[route.url.text] = make(route.url)
        self._sink_of_url = by_url
        self.sinks = list(by_url.values())
        self._by_topic: dict[str, Sink | None] = {}  # topic -> its sink, learnt on first sight

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        topic = event.topic
        try:
            sink = self._by_topic[topic]
        except KeyError:
            route = route_for(self._routes, topic)
            sink = self._by_topic[topic] = None if route is None else self._sink_of_url[route.url.text]
        if sink is None:
            return Dead(NO_ROUTE, f"no route for topic {topic!r}")
        return sink.produce(event, report)

    def poll(self, timeout: float) -> None:
        # The first sink waits up to the timeout; the others only serve what is ready.
        for i, sink in enumerate(self.sinks):
            sink.poll(timeout if i == 0 else 0)

    def flush(self, timeout: float) -> int:
        return sum(sink.flush(timeout) for sink in self.sinks)

    def healthy(self) -> bool:
        return all(sink.healthy() for sink in self.sinks)

    def close(self, timeout: float) -> None:
        for sink in self.sinks:
            sink.close(timeout)


def build(routes: list[Route], make: Callable[[SinkURL], Sink]) -> Sink:
    """The sink for ``routes``: the one sink itself for a lone catch-all route, else a Router."""
    if len(routes) == 1 and routes[0].glob == "*":
        return make(routes[0].url)
    return Router(routes, make)
