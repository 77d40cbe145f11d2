"""Google Cloud Pub/Sub (``pubsub://PROJECT/TOPIC``) against Google's emulator: delivery and
per-key order over several keys, the emulator stopped and started again mid-run with nothing
lost, and what Pub/Sub refuses for good dead-lettered."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import outbox
from outbox.relay.config import RelayConfig
from outbox.sinks.make import routed
from outbox.sinks.pubsub import ordering_key
from outbox.sinks.routes import parse_routes
from tests.helpers import count, running_relay, wait_for
from tests.pubsub_emulator import PROJECT, Emulator, Reader, Received

KEYS = 7


@pytest.fixture
def emulator() -> Iterator[Emulator]:
    """An emulator of this test's own (a test may stop and start it)."""
    server = Emulator().start()
    try:
        with server.environment():
            yield server
    finally:
        server.stop()


@pytest.fixture
def pubsub_topic() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def _config(dsn: str, schema: str, **extra: Any) -> RelayConfig:
    return RelayConfig(
        dsn,
        schema=schema,
        poll_interval=0.1,
        delivery_timeout=3.0,
        lease=10.0,
        retry=outbox.RetryPolicy(base=0.2, cap=1.0, max_attempts=1000),
        **extra,
    )


def _sink(topic: str, config: RelayConfig) -> Any:
    return routed(parse_routes([f"*=pubsub://{PROJECT}/{topic}"], None), config.delivery_timeout)


def _write(dsn: str, schema: str, topic: str, start: int, n: int) -> list[str]:
    rows = [
        {"topic": "orders", "key": f"k{i % KEYS}", "payload": {"seq": i}, "headers": {"tenant": "acme"}}
        for i in range(start, start + n)
    ]
    with psycopg.connect(dsn) as conn:
        return [str(i) for i in outbox.enqueue_many(conn, rows, schema=schema)]


def _assert_key_order(received: list[Received]) -> None:
    """Each key's first deliveries in the order written (a redelivery repeats, never reorders)."""
    last: dict[str, int] = {}
    seen: set[str] = set()
    for m in received:
        if m.event_id in seen:
            continue
        seen.add(m.event_id)
        seq = json.loads(m.data)["seq"]
        assert seq > last.get(m.ordering_key, -1), f"key {m.ordering_key}: {seq} after {last[m.ordering_key]}"
        last[m.ordering_key] = seq


def test_delivery_and_order_over_several_keys(
    pg_dsn: str, schema: str, emulator: Emulator, pubsub_topic: str
) -> None:
    reader = Reader(emulator, emulator.create(pubsub_topic))
    config = _config(pg_dsn, schema)
    try:
        with running_relay(config, _sink(pubsub_topic, config)):
            ids = _write(pg_dsn, schema, pubsub_topic, 0, 700)
            wait_for(lambda: count(pg_dsn, schema, "delivered") == len(ids), timeout=60, what="the drain")
        received = reader.wait(len(ids))
    finally:
        reader.close()
    assert {m.event_id for m in received} == set(ids)
    _assert_key_order(received)
    first = received[0]
    assert first.attributes["tenant"] == "acme" and first.attributes["content-type"] == "application/json"
    assert first.ordering_key.startswith("k") and "event-key" not in first.attributes
    with psycopg.connect(pg_dsn) as conn:
        refs = dict(conn.execute(f'SELECT event_id::text, sink_ref FROM "{schema}".delivered').fetchall())
    assert {m.event_id: m.message_id for m in received} == refs, "the archive keeps each message id"


def test_the_emulator_stopped_and_started_mid_run_loses_nothing_and_keeps_order(
    pg_dsn: str, schema: str, emulator: Emulator, pubsub_topic: str
) -> None:
    """Stopped while a wave is on its way: what it acknowledged before is archived; everything
    else fails (the topic gone with the emulator's memory counts as the sink being down), waits
    in the outbox with its key paused, and after the restart goes in order."""
    subscription = emulator.create(pubsub_topic)
    reader = Reader(emulator, subscription)
    config = _config(pg_dsn, schema, batch_size=100)
    try:
        with running_relay(config, _sink(pubsub_topic, config)):
            ids = _write(pg_dsn, schema, pubsub_topic, 0, 3000)
            wait_for(lambda: len(reader.received) >= 300, timeout=60, what="the wave under way")
            emulator.stop()
            stopped_at = time.time()
            wait_for(
                lambda: count(pg_dsn, schema, "events", "attempts > 0") > 0, timeout=30, what="failed sends"
            )
            assert count(pg_dsn, schema, "events") > 0, "the wave went through before the emulator stopped"
            emulator.start()
            emulator.create(pubsub_topic)
            # Pub/Sub keeps nothing for a topic without a subscription: what the relay published
            # between the topic made again and its subscription was dropped by design. What it
            # claimed after both exist must be read.
            subscribed_at = time.time()
            wait_for(lambda: count(pg_dsn, schema, "delivered") == len(ids), timeout=120, what="the rest")
        assert subscribed_at > stopped_at
        with psycopg.connect(pg_dsn) as conn:
            after = {
                r[0]
                for r in conn.execute(
                    f'SELECT event_id::text FROM "{schema}".delivered WHERE delivered_at >= to_timestamp(%s)',
                    (subscribed_at,),
                )
            }
        wait_for(lambda: after <= {m.event_id for m in reader.received}, timeout=60, what="the rest read")
    finally:
        reader.close()
    assert count(pg_dsn, schema, "dead_letters") == 0 and count(pg_dsn, schema, "events") == 0
    assert count(pg_dsn, schema, "delivered", "attempts > 1") > 0, "nothing was retried"
    assert len(after) > 0
    # What the first emulator acknowledged and held unread when it was killed went with its
    # memory (a broker's durability, not the relay's); everything the relay had not delivered
    # by then arrived, in order.
    _assert_key_order(reader.received)


def test_what_pubsub_refuses_for_good_is_dead_lettered_and_the_rest_goes_on(
    pg_dsn: str, schema: str, emulator: Emulator, pubsub_topic: str
) -> None:
    reader = Reader(emulator, emulator.create(pubsub_topic))
    config = _config(pg_dsn, schema, on_dead="continue")
    with psycopg.connect(pg_dsn) as conn:
        big = outbox.enqueue(conn, "orders", b"x" * 10_500_000, key="big", schema=schema)
        crowded = outbox.enqueue(
            conn,
            "orders",
            b"{}",
            key="crowded",
            headers={f"goog-h{i}": "v" * 100 for i in range(12)},
            schema=schema,
        )
        ok = _write(pg_dsn, schema, pubsub_topic, 0, 20)
        odd = outbox.enqueue(
            conn, "orders", b"{}", key=b"\xff\xfe", headers={"googly": "1", "bin": b"\xff"}, schema=schema
        )
        long = outbox.enqueue(conn, "orders", b"{}", key="long", headers={"long": "v" * 2000}, schema=schema)
        # Issue 70: a text key too long for an ordering key or an attribute was always dead-lettered
        # (enqueue takes 2,048 bytes); and a text key shaped like another key's digest.
        long_key = outbox.enqueue(conn, "orders", b"{}", key="L" * 2000, schema=schema)
        lookalike = outbox.enqueue(conn, "orders", b"{}", key=ordering_key(b"\xff\xfe")[0], schema=schema)
    try:
        with running_relay(config, _sink(pubsub_topic, config)):
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="the drain")
        received = reader.wait(len(ok) + 3)
    finally:
        reader.close()
    with psycopg.connect(pg_dsn) as conn:
        dead = dict(conn.execute(f'SELECT event_id::text, kind FROM "{schema}".dead_letters').fetchall())
    assert dead == {
        str(big): "message_too_large",
        str(crowded): "invalid_attributes",
        str(long): "invalid_attributes",
    }
    by_id = {m.event_id: m for m in received}
    assert set(by_id) == {*ok, str(odd), str(long_key), str(lookalike)}
    assert by_id[str(long_key)].ordering_key == ordering_key(b"L" * 2000)[0]
    assert "event-key" not in by_id[str(long_key)].attributes, "the digest alone stands for it"
    assert by_id[str(lookalike)].ordering_key != by_id[str(odd)].ordering_key
    assert by_id[str(lookalike)].attributes["event-key"] == ordering_key(b"\xff\xfe")[0]
    message = by_id[str(odd)]
    assert message.ordering_key.startswith("sha256-")  # not UTF-8: a digest, the key kept beside
    assert json.loads(message.attributes["outbox-headers"]) == {
        "event-key": {"base64": "//4="},
        "googly": "1",
        "bin": {"base64": "/w=="},
    }


@contextlib.contextmanager
def _unreachable(kind: str) -> Iterator[str]:
    """An address where Pub/Sub does not answer: a port nothing listens on (``refused``), or one
    that accepts connections and never says a word (``silent``: a network that blackholes)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        port = listener.getsockname()[1]
        if kind == "silent":
            listener.listen(16)
        else:
            listener.close()
        yield f"127.0.0.1:{port}"


@pytest.mark.parametrize("kind", ["refused", "silent"])
def test_a_publish_pubsub_does_not_take_ends_with_its_attempt_and_nothing_retries_it_after(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With message ordering on, Google's publisher stretches any retry it is given to 2**32 s,
    the attempt's timeout too: a batch of a publisher the sink had dropped in an outage went on
    retrying on a thread of its own, and published its events when the service came back, after
    the relay had sent them (and later events of their keys) again. The sink's one attempt
    ends within the delivery timeout, reported to be retried, and no thread is left with it."""
    from outbox.events import ClaimedEvent
    from outbox.sinks.base import Retry
    from outbox.sinks.pubsub import PubSubSink
    from outbox.sinks.routes import parse_url

    before = set(threading.enumerate())

    def commits() -> list[threading.Thread]:  # the publisher commits each batch on a thread
        return [
            t for t in threading.enumerate() if t not in before and t.name == "Thread-CommitBatchPublisher"
        ]

    with _unreachable(kind) as address:
        monkeypatch.setenv("PUBSUB_EMULATOR_HOST", address)
        sink = PubSubSink(parse_url(f"pubsub://{PROJECT}/orders", "route"), timeout=2.0)
        event = ClaimedEvent(1, str(uuid.uuid4()), "orders", b"k", b"{}", [], time.time(), 0)
        outcomes: list[Any] = []
        try:
            sink.produce(event, outcomes.append)
            wait_for(lambda: sink.poll(0.1) or outcomes, timeout=15, what="the report")
            assert isinstance(outcomes[0], Retry), outcomes
            # The commit gives up within its attempt's timeout (2 s), not at 2**32 s.
            wait_for(lambda: not commits(), timeout=10, what="the publisher's commit to end")
        finally:
            sink.close(1)
