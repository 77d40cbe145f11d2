"""Routing against the real servers: an unrouted topic is a parked dead letter, then a route
and a redrive deliver it first and its key's later events after it, in order."""

from __future__ import annotations

import json

import psycopg

import outbox
from outbox.operate import dead
from outbox.relay.relay import RelayConfig
from outbox.sinks import router
from outbox.sinks.base import Sink
from outbox.sinks.kafka import KafkaSink
from outbox.sinks.routes import SinkURL, parse_routes
from tests.helpers import count, read_topic, running_relay, wait_for


def _sink(routes: list[str]) -> Sink:
    def make(url: SinkURL) -> Sink:
        return KafkaSink(url.kafka_bootstrap, delivery_timeout=5)

    return router.Router(parse_routes(routes, None), make)


def test_an_unrouted_topic_parks_its_key_until_routed_and_redriven(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    routed, unrouted = f"{topic}.a", f"{topic}.b"
    with psycopg.connect(pg_dsn) as conn:
        for seq in range(3):
            outbox.enqueue(conn, routed, {"seq": seq}, key="r", schema=schema)
        outbox.enqueue(conn, unrouted, {"seq": 0}, key="u", schema=schema)
        outbox.enqueue(conn, routed, {"seq": 1}, key="u", schema=schema)  # same key, routed topic
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1)
    with running_relay(config, lambda: _sink([f"{topic}.a=kafka://{kafka}"])):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 3, timeout=30)
        wait_for(lambda: count(pg_dsn, schema, "dead_letters", "parked") == 1, timeout=30)
    with psycopg.connect(pg_dsn) as conn:
        ids = dead.select(conn, schema, dead.Selector(key=b"u"))
        [letter] = dead.details(conn, schema, ids)
        assert letter["error"] == f"no route for topic '{unrouted}'" and letter["attempts"] == 1
        assert letter["waiting"] == 1  # the key's later event is parked, not delivered out of order
        assert count(pg_dsn, schema, "events") == 1
        dead.redrive(conn, schema, ids)
        conn.commit()
    routes = [f"{topic}.a=kafka://{kafka}", f"{topic}.*=kafka://{kafka}"]
    with running_relay(config, lambda: _sink(routes)):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30)
    assert json.loads(read_topic(kafka, unrouted, 1)[0].value) == {"seq": 0}
    by_key = [(m.key, json.loads(m.value)["seq"]) for m in read_topic(kafka, routed, 4)]
    assert [s for k, s in by_key if k == b"r"] == [0, 1, 2]
    assert [s for k, s in by_key if k == b"u"] == [1]
    assert count(pg_dsn, schema, "dead_letters") == 0
