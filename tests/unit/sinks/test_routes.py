"""outbox.routes and the router sink: which sink each topic goes to (pure)."""

from __future__ import annotations

import threading

import pytest

from outbox.errors import ConfigError
from outbox.events import ClaimedEvent
from outbox.sinks.base import Dead, Delivered, Outcome, Report, Sink, SinkWrapper, wake_of
from outbox.sinks.router import NO_ROUTE, SLICE, Router, unwrap
from outbox.sinks.routes import parse_route, parse_routes, route_for


def test_routes_parse_in_order_and_kafka_bootstrap_is_the_last_catch_all() -> None:
    routes = parse_routes(
        ["orders.*=kafka://a:9092,b:9092", "audit=kafka://c:9092 pay.?=kafka://d:1"], "k:9092"
    )
    assert [r.display for r in routes] == [
        "orders.*=kafka://a:9092,b:9092",
        "audit=kafka://c:9092",
        "pay.?=kafka://d:1",
        "*=kafka://k:9092",
    ]
    assert routes[0].url.kafka_bootstrap == "a:9092,b:9092"
    assert route_for(routes, "orders.placed") is routes[0]
    assert route_for(routes, "pay.x") is routes[2]
    assert route_for(routes, "Orders.placed") is routes[3]  # case-sensitive, then the catch-all
    assert route_for(routes[:3], "other") is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("orders.*", "--route 'orders.*': expected GLOB=URL"),
        ("=kafka://a:1", "expected GLOB=URL"),
        ("x=", "expected GLOB=URL"),
        ("x=ftp://u:hunter2@h/p", "unknown sink scheme ftp://"),
        ("x=kafka://", "expected kafka://host:port"),
        ("x=kafka://host", "expected kafka://host:port"),
        ("x=kafka://h:1/path", "expected kafka://host:port"),
    ],
)
def test_a_malformed_route_is_refused_naming_it_without_its_password(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("*", r"\*").replace("?", r"\?")) as exc:
        parse_route(text)
    assert "hunter2" not in str(exc.value)


def test_no_route_at_all_is_refused() -> None:
    with pytest.raises(ConfigError, match="no sink to deliver to"):
        parse_routes([], None)


class _Recording:
    """A stand-in sink (pure logic): remembers what it was given."""

    def __init__(self) -> None:
        self.topics: list[str] = []
        self.polled: list[float] = []

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        self.topics.append(event.topic)
        return Delivered()

    def poll(self, timeout: float) -> None:
        self.polled.append(timeout)

    def flush(self, timeout: float) -> int:
        return 0

    def healthy(self) -> bool:
        return True

    def close(self, timeout: float) -> None:
        pass


def _event(topic: str) -> ClaimedEvent:
    return ClaimedEvent(1, "e", topic, None, b"", [], 0.0, 0)


def test_the_router_sends_each_topic_to_its_first_route_and_refuses_the_rest() -> None:
    made: dict[str, _Recording] = {}

    def make(url: object) -> Sink:
        return made.setdefault(url.text, _Recording())  # type: ignore[attr-defined]

    routes = parse_routes(["a.*=kafka://a:1", "b=kafka://b:1", "a.x=kafka://b:1"], None)
    router = Router(routes, make)
    assert len(router.sinks) == 2  # two routes to the same URL share one sink
    for topic in ("a.x", "b", "a.y", "a.x"):
        assert router.produce(_event(topic), lambda o: None) == Delivered()
    assert made["kafka://a:1"].topics == ["a.x", "a.y", "a.x"] and made["kafka://b:1"].topics == ["b"]
    refused = router.produce(_event("c"), lambda o: None)
    assert refused == Dead(NO_ROUTE, "no route for topic 'c'")
    router.poll(0.05)
    # Both sinks are served; neither is waited on for the whole timeout (the other's reports
    # would wait behind it).
    for sink in made.values():
        assert sink.polled and max(sink.polled) <= SLICE


def test_a_lone_sink_is_polled_with_the_whole_timeout() -> None:
    only = _Recording()
    router = Router(parse_routes([], "k:1"), lambda url: only)
    router.poll(0.05)
    assert only.polled == [0.05]


class _Signalling(_Recording):
    """A stand-in sink that sets ``wake`` when its reports are ready (as Kafka's does)."""

    def __init__(self) -> None:
        super().__init__()
        self.wake = threading.Event()


class _Holding(SinkWrapper):
    """A wrapper that holds reports back in its own poll: the relay must poll it."""

    def poll(self, timeout: float) -> int | None:
        return self.inner.poll(timeout)


def test_the_relay_waits_on_a_sink_s_wake_up_only_where_every_report_sets_it() -> None:
    """wake_of: the event the relay's loop waits on instead of polling in slices. A sink that
    polls (a user's own), a router with one such sink, or a wrapper with a poll of its own would
    leave reports unseen until a timeout: the relay polls them."""
    plain, signalling = _Recording(), _Signalling()
    assert wake_of(plain) is None
    assert wake_of(signalling) is signalling.wake
    assert wake_of(SinkWrapper(signalling)) is signalling.wake  # passes reports straight through
    assert wake_of(_Holding(signalling)) is None
    both = [parse_route(f"{t}=kafka://h:{i}") for i, t in enumerate(("a", "b"), 1)]
    sinks = iter([_Signalling(), _Signalling()])
    router = Router(both, lambda _url: next(sinks))
    shared = wake_of(router)
    assert shared is not None and all(unwrap(s).wake is shared for s in router.sinks)
    mixed = iter([_Signalling(), _Recording()])
    assert wake_of(Router(both, lambda _url: next(mixed))) is None
