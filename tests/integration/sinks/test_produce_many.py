"""The Kafka sink's batch path (KafkaSink.produce_many): queued in order, stopped before the first
refused event, and a refusal in the middle of a batch still holds its key's later events."""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import psycopg
import pytest

import outbox
from outbox.events import ClaimedEvent
from outbox.relay.relay import RelayConfig
from outbox.sinks.base import Delivered, Outcome, Sink, SinkWrapper
from outbox.sinks.kafka import KafkaSink
from outbox.sinks.router import Router
from outbox.sinks.routes import parse_routes
from tests.helpers import count, first_occurrences, read_topic, running_relay, wait_for


def _event(i: int, topic: str, payload: bytes, key: bytes) -> ClaimedEvent:
    return ClaimedEvent(
        i, f"00000000-0000-4000-8000-{i:012d}", topic, key, payload, [("n", b"%d" % i)], 0.0, 0
    )


def _serve(sink: KafkaSink, outcomes: dict[int, Outcome], expected: int) -> None:
    wait_for(lambda: sink.poll(0.1) is not None and len(outcomes) >= expected, timeout=30, what="reports")


def test_produce_many_queues_every_event_in_order_with_one_report_each(kafka: str, topic: str) -> None:
    sink = KafkaSink(kafka, delivery_timeout=10)
    try:
        events = [_event(i, topic, b"p%d" % i, b"k%d" % (i % 3)) for i in range(1, 501)]
        outcomes: dict[int, Outcome] = {}  # deliveries stored here; nothing may fail
        failed: dict[int, Outcome] = {}
        assert sink.produce_many(events, outcomes, failed.__setitem__) == len(events)
        _serve(sink, outcomes, len(events))
        assert failed == {}
    finally:
        sink.close(5)
    assert all(isinstance(o, Delivered) for o in outcomes.values())
    messages = read_topic(kafka, topic, 500)
    assert sorted(m.value for m in messages) == sorted(e.payload for e in events)
    for key in (b"k0", b"k1", b"k2"):  # one key, one partition: produce order
        assert [m.value for m in messages if m.key == key] == [e.payload for e in events if e.key == key]


def test_produce_many_stops_before_a_refused_event_and_queues_nothing_after_it(
    kafka: str, topic: str
) -> None:
    sink = KafkaSink(kafka, delivery_timeout=10)
    try:
        events = [_event(i, topic, b"small%d" % i, b"k") for i in range(1, 11)]
        events[4] = _event(5, topic, b"x" * 2_000_000, b"k")  # over message.max.bytes: refused by the client
        outcomes: dict[int, Outcome] = {}
        assert sink.produce_many(events, outcomes, outcomes.__setitem__) == 4
        _serve(sink, outcomes, 4)
        # An illegal topic name is left to produce(), which dead-letters it: nothing is queued.
        assert sink.produce_many([_event(20, "no spaces!", b"x", b"k")], {}, outcomes.__setitem__) == 0
    finally:
        sink.close(5)
    assert sorted(outcomes) == [0, 1, 2, 3]
    assert [m.value for m in read_topic(kafka, topic, 4)] == [b"small1", b"small2", b"small3", b"small4"]


def test_an_event_refused_mid_batch_holds_its_keys_later_events_of_the_batch(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    """One transaction, one batch: K's third event is too large for the broker. K's later events
    must wait behind its dead letter (parked), every other key's events go out, in order."""
    rows = []
    for seq in range(6):
        for key in ("K", "A", "B"):
            big = key == "K" and seq == 2
            payload = b"x" * 2_000_000 if big else json.dumps({"k": key, "seq": seq}).encode()
            rows.append({"topic": topic, "key": key, "payload": payload})
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(conn, rows, schema=schema)
    with running_relay(RelayConfig(pg_dsn, schema=schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 2 + 6 + 6, timeout=30, what="deliveries")
        assert count(pg_dsn, schema, "dead_letters", "parked") == 1
        assert count(pg_dsn, schema, "events") == 3, "K's later events must wait behind its dead letter"
    sent: dict[str, list[int]] = {"K": [], "A": [], "B": []}
    for m in first_occurrences(read_topic(kafka, topic, 14)):
        body = json.loads(m.value)
        sent[body["k"]].append(body["seq"])
    assert sent == {"K": [0, 1], "A": list(range(6)), "B": list(range(6))}


# Twice the waits below: only send_now() gets a message out sooner. With 3 s, a batch sent at once
# once took over the 1.5 s between the relay's wake and its archive in a loaded CI run.
LINGER_MS = 8000


def _long_linger_sink(kafka: str, wrap: str) -> Callable[[], Sink]:
    def plain() -> Sink:
        return KafkaSink(kafka, {"linger.ms": LINGER_MS}, delivery_timeout=30)

    if wrap == "plain":
        return plain
    if wrap == "wrapper":
        return lambda: SinkWrapper(plain())
    routes = parse_routes([], kafka)
    return lambda: Router(routes, lambda url: plain())


def _warm_up(pg_dsn: str, schema: str, topic: str) -> None:
    """One event acked first: the first message of a topic the client has no metadata for waits
    out the whole linger whatever the relay does."""
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, topic, {"warm": "up"}, key="w", schema=schema)
    wait_for(lambda: count(pg_dsn, schema, "delivered") == 1, timeout=30, what="the first ack")


@pytest.mark.parametrize("wrap", ["plain", "wrapper", "router"])
def test_a_batch_that_is_not_full_is_sent_without_waiting_for_the_linger(
    pg_dsn: str, schema: str, kafka: str, topic: str, wrap: str
) -> None:
    """No backlog: the relay's send_now() gets the batch out at once, through wrappers and the
    router alike, instead of after linger.ms."""
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1, batch_size=100)
    with running_relay(config, _long_linger_sink(kafka, wrap)):
        _warm_up(pg_dsn, schema, topic)
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue(conn, topic, {"n": 1}, key="k", schema=schema)
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 2, timeout=LINGER_MS / 2000, what="the ack")


def test_a_full_batch_is_left_to_the_linger(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    """A full batch means a backlog: the client batches it with what follows (no send_now), so
    nothing of it is acked before the linger runs out; then all of it is."""
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1, batch_size=5)
    with running_relay(config, _long_linger_sink(kafka, "plain")) as relay:
        _warm_up(pg_dsn, schema, topic)
        rows = [{"topic": topic, "payload": {"n": i}, "key": "k"} for i in range(5)]
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue_many(conn, rows, schema=schema)
        wait_for(lambda: relay.stats.claimed == 6, timeout=10, what="the claim")
        time.sleep(LINGER_MS / 2000)
        assert count(pg_dsn, schema, "delivered") == 1
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 6, timeout=30, what="the lingered acks")
