"""Committed events reach Kafka byte-exact, in per-key order; rolled-back ones never do."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg

import outbox
from outbox.relay.relay import RelayConfig
from outbox.sinks.kafka import KafkaSink
from tests.helpers import count, read_topic, running_relay, wait_for
from tests.sinks import FlakySink


def test_committed_events_arrive_byte_exact_and_rolled_back_never(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    sent: dict[str, dict[str, Any]] = {}
    with psycopg.connect(pg_dsn) as conn:
        with conn.transaction():
            eid = outbox.enqueue(
                conn,
                topic,
                b"\x00\xffraw bytes",
                key=b"\x01k",
                schema=schema,
                headers={"h-text": "v\u00e9", "h-bin": b"\xfe\x00\x01", "h-nul": "a\x00b"},
            )
            sent[str(eid)] = {
                "key": b"\x01k",
                "value": b"\x00\xffraw bytes",
                "headers": {
                    "h-text": "v\u00e9".encode(),
                    "h-bin": b"\xfe\x00\x01",
                    "h-nul": b"a\x00b",
                },
            }
            eid = outbox.enqueue(conn, topic, "text \u2603", key="k\u00e9", schema=schema)
            sent[str(eid)] = {
                "key": "k\u00e9".encode(),
                "value": "text \u2603".encode(),
                "headers": {},
            }
            eid = outbox.enqueue(conn, topic, {"n": 1, "s": "\u00e9"}, schema=schema)
            sent[str(eid)] = {
                "key": None,
                "value": '{"n":1,"s":"\u00e9"}'.encode(),
                "headers": {"content-type": b"application/json"},
            }
        rolled_back: list[uuid.UUID] = []
        try:
            with conn.transaction():
                rolled_back.append(outbox.enqueue(conn, topic, b"never", schema=schema))
                raise RuntimeError("business logic failed")
        except RuntimeError:
            pass
        with conn.transaction():
            ids = outbox.enqueue_many(
                conn,
                [{"topic": topic, "payload": f"m{i}", "key": "many"} for i in range(50)],
                schema=schema,
            )
            for i, eid in enumerate(ids):
                sent[str(eid)] = {"key": b"many", "value": f"m{i}".encode(), "headers": {}}

    with running_relay(RelayConfig(pg_dsn, schema=schema), bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == len(sent), what="archive")
    messages = read_topic(kafka, topic, len(sent))

    assert len(messages) == len(sent)
    got = {m.event_id: m for m in messages}
    assert str(rolled_back[0]) not in got
    assert set(got) == set(sent)
    for eid, want in sent.items():
        m = got[eid]
        assert m.key == want["key"]
        assert m.value == want["value"]
        assert {k: v for k, v in m.headers.items() if k != "event-id"} == want["headers"]
    assert count(pg_dsn, schema, "events") == 0


def test_archive_keeps_kafka_coordinates(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn,
            [{"topic": topic, "payload": b"x", "key": str(i)} for i in range(20)],
            schema=schema,
        )
    with running_relay(RelayConfig(pg_dsn, schema=schema), bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 20)
    by_id = {m.event_id: (m.partition, m.offset) for m in read_topic(kafka, topic, 20)}
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            f'SELECT event_id, sink_partition, sink_offset, attempts FROM "{schema}".delivered'
        ).fetchall()
    assert {str(e): (p, o) for e, p, o, _ in rows} == by_id
    assert {a for *_, a in rows} == {1}


def test_per_key_order_holds_through_retries(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    keys, per_key = 20, 100
    with psycopg.connect(pg_dsn) as conn:
        for seq in range(per_key):  # one transaction per round: commit order == seq order
            with conn.transaction():
                outbox.enqueue_many(
                    conn,
                    [{"topic": topic, "key": f"k{k}", "payload": {"k": k, "seq": seq}} for k in range(keys)],
                    schema=schema,
                )
    total = keys * per_key
    sinks: list[FlakySink] = []

    def factory() -> FlakySink:
        sinks.append(FlakySink(KafkaSink(kafka, delivery_timeout=10), 0.05, seed=7))
        return sinks[-1]

    config = RelayConfig(
        pg_dsn,
        schema=schema,
        batch_size=200,
        retry=outbox.RetryPolicy(base=0.05, cap=0.2, max_attempts=50),
    )
    with running_relay(config, factory):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == total, timeout=60)
    assert sinks[0].failures > 0, "the test injected no failure"

    seen: set[str] = set()
    last: dict[int, int] = {}
    for m in read_topic(kafka, topic, total):
        if m.event_id in seen:
            continue
        seen.add(m.event_id)
        body = json.loads(m.value)
        assert body["seq"] > last.get(body["k"], -1), f"key {body['k']} out of order"
        last[body["k"]] = body["seq"]
    assert len(seen) == total
    assert count(pg_dsn, schema, "delivered", "attempts > 1") > 0
