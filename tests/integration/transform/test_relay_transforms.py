"""Transforms in the relay (--transform): events reshaped, re-keyed, re-routed, dropped and
dead-lettered on both captures, against the real PostgreSQL and Kafka; per-key order held through
retries of re-keyed events."""

from __future__ import annotations

import json
from typing import Any

import psycopg
import pytest

import outbox
from outbox.operate import status
from outbox.relay.relay import RelayConfig
from outbox.sinks.kafka import KafkaSink
from tests.helpers import Message, count, first_occurrences, read_topic, running_relay, wait_for
from tests.sinks import FlakySink

RESHAPE = "tests.transforms:reshape"
LONELY = "lonely"  # the key of the event the transform raises on, and of one event behind it


def _write(dsn: str, schema: str, topic: str, n: int) -> dict[str, Any]:
    """``n`` events over five keys (every tenth dropped by the transform), then one it raises on
    and one of the same key behind it; what the relay should make of them."""
    events: list[dict[str, Any]] = [
        {"topic": topic, "key": f"k{i % 5}", "payload": {"n": i, "drop": i % 10 == 3}} for i in range(n)
    ]
    events.append({"topic": topic, "key": LONELY, "payload": {"n": n, "boom": True}})
    events.append({"topic": topic, "key": LONELY, "payload": {"n": n + 1}})
    with psycopg.connect(dsn) as conn:
        ids = [str(i) for i in outbox.enqueue_many(conn, events, schema=schema)]
    dropped = {ids[i] for i in range(n) if i % 10 == 3}
    return {
        "sent": {ids[i]: i for i in range(n) if i % 10 != 3},
        "dropped": dropped,
        "failed": ids[n],
        "parked": ids[n + 1],
    }


@pytest.mark.parametrize("capture", ["table", "wal"])
def test_transform_reshapes_rekeys_reroutes_drops_and_dead_letters(
    request: pytest.FixtureRequest, capture: str, kafka: str, topic: str
) -> None:
    dsn: str = request.getfixturevalue("pg_dsn" if capture == "table" else "wal_dsn")
    schema: str = request.getfixturevalue("schema" if capture == "table" else "wal_schema")
    glob = f"{topic}*"  # the re-routed topic (<topic>.v2) matches too: a transform runs once
    config = RelayConfig(dsn, schema=schema, poll_interval=0.1, transform=[f"{glob}={RESHAPE}"])
    with running_relay(config, bootstrap=kafka):
        plan = _write(dsn, schema, topic, 50)
        # Everything but the event parked behind the dead letter of its key leaves the table.
        wait_for(lambda: count(dsn, schema, "dead_letters") == 1, timeout=60, what="the dead letter")
        wait_for(lambda: count(dsn, schema, "delivered") == 50, timeout=60, what="the archive")
    assert count(dsn, schema, "events") == 1
    messages = first_occurrences(read_topic(kafka, f"{topic}.v2", len(plan["sent"])))
    assert {m.event_id for m in messages} == set(plan["sent"])
    assert read_topic(kafka, topic, 0, timeout=2) == [], "nothing goes to the old topic"
    last: dict[bytes, int] = {}
    for m in messages:
        body = json.loads(m.value)
        n = plan["sent"][m.event_id]
        assert body == {"order": n, "version": 2}
        assert m.key == f"new-k{n % 5}".encode()
        assert m.headers["x-transformed"] == b"yes"
        assert m.headers["content-type"] == b"application/json"
        assert body["order"] > last.get(m.key, -1), f"key {m.key!r}: order broken"
        last[m.key] = body["order"]
    with psycopg.connect(dsn) as conn:
        archived = dict(
            conn.execute(f'SELECT event_id::text, filtered_by FROM "{schema}".delivered').fetchall()
        )
        kind, error, key = conn.execute(f'SELECT kind, error, key FROM "{schema}".dead_letters').fetchone()  # type: ignore[misc]
        payload = conn.execute(
            f'SELECT payload FROM "{schema}".delivered WHERE filtered_by IS NULL LIMIT 1'
        ).fetchone()
        pending = conn.execute(f'SELECT event_id::text FROM "{schema}".events').fetchone()
        report = status.collect(conn, schema)
    assert {e for e, by in archived.items() if by is not None} == plan["dropped"]
    assert set(archived.values()) == {None, f"{glob}={RESHAPE}"}
    assert kind == "transform_failed"
    assert error == f"transform {RESHAPE} raised ValueError: cannot reshape order 50"
    assert key == LONELY.encode()
    assert pending == (plan["parked"],), "the key's next event waits behind its dead letter"
    assert payload is not None and b'"drop"' in payload[0], "the archive keeps the event as written"
    assert (report["delivered_last_hour"], report["filtered_last_hour"]) == (45, 5)
    assert "delivered last hour  45 (and 5 filtered)" in status.render(report)


def test_a_key_sent_under_new_keys_keeps_its_order_through_retries(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    """Per-key order is the order of the key an event was written with: a transform sends each
    key's events under two keys, a third of the sends fail, and no event of a written key is
    delivered while an earlier one of it waits to be retried (holds and claims go by the written
    key). Each new key's events reach Kafka in order too."""
    n = 300
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn, [{"topic": topic, "key": f"k{i % 7}", "payload": {"n": i}} for i in range(n)], schema=schema
        )
    config = RelayConfig(
        pg_dsn,
        schema=schema,
        poll_interval=0.1,
        batch_size=40,
        transform=[f"{topic}=tests.transforms:split"],
        retry=outbox.RetryPolicy(base=0.01, cap=0.05, max_attempts=1000),
    )

    def sink() -> FlakySink:
        return FlakySink(KafkaSink(kafka, delivery_timeout=config.delivery_timeout), 0.3, seed=7)

    with running_relay(config, sink):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == n, timeout=90, what="the drain")
    assert count(pg_dsn, schema, "delivered", "attempts > 1") > 0, "no retry happened"
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            f'SELECT key, delivered_at, attempts FROM "{schema}".delivered ORDER BY id'
        ).fetchall()
    last: dict[bytes, Any] = {}
    for key, at, _ in rows:  # delivered_at: the claim's transaction time
        assert at >= last.get(key, at), (
            f"key {key!r}: an event delivered in an earlier batch than one before it"
        )
        last[key] = at
    messages: list[Message] = first_occurrences(read_topic(kafka, f"{topic}.v2", n))
    seen: dict[bytes, int] = {}
    for m in messages:
        order = json.loads(m.value)["order"]
        assert m.key is not None
        assert order > seen.get(m.key, -1), f"key {m.key!r}: {order} after {seen.get(m.key)}"
        seen[m.key] = order
    assert len(messages) == n


def test_what_a_writer_smuggles_through_a_transform_is_checked_like_its_own_headers(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    """The attack: a writer cannot set event-id (consumers deduplicate on it) or a header name
    that ends a line early, but a transform copies headers out of its payload. What the
    transform returns is checked as enqueue checks a writer: dead letters, nothing forged sent."""
    smuggled = [{"event-id": "00000000-0000-0000-0000-000000000000"}, {"x\r\nInjected": "1"}, {"ok": "1"}]
    with psycopg.connect(pg_dsn) as conn:
        ids = outbox.enqueue_many(
            conn, [{"topic": topic, "payload": {"headers": h}} for h in smuggled], schema=schema
        )
    config = RelayConfig(
        pg_dsn, schema=schema, poll_interval=0.1, transform=[f"{topic}=tests.transforms:headers_from_payload"]
    )
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="the drain")
    with psycopg.connect(pg_dsn) as conn:
        dead = dict(conn.execute(f'SELECT event_id::text, error FROM "{schema}".dead_letters').fetchall())
    assert set(dead) == {str(ids[0]), str(ids[1])}
    assert "'event-id' is set by outbox" in dead[str(ids[0])]
    assert "must be 1-256 characters of an HTTP token" in dead[str(ids[1])]
    (message,) = read_topic(kafka, topic, 1)
    assert message.event_id == str(ids[2]) and message.headers["ok"] == b"1"
