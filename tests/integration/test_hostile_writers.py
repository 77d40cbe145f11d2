"""A writer's topic, key, headers and payload are not trusted: each attack mounted on the real
sink server (NATS JetStream, the webhook receiver, RabbitMQ, Redis, Kafka) and the real consumer.

The writer chooses these values; nothing in them may make the relay, a sink server or a
consumer do more than deliver the event (docs/security.md, "Writers").
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import posixpath
import threading
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import unquote

import nats
import psycopg
import pytest
from confluent_kafka import Producer
from psycopg import sql

import outbox
from outbox.inbox import Delivery, consume_kafka
from outbox.relay.config import RelayConfig
from outbox.relay.retry import RetryPolicy
from outbox.sinks.claim_check import PostgresStore
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from outbox.sinks.signing import parse_secrets
from outbox.store.migrate import migrate
from tests.helpers import count, read_topic, running_relay, wait_for
from tests.sink_servers import SINKS, HttpTarget, NatsTarget, target

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
GROUP_SETTINGS = {"auto.offset.reset": "earliest", "session.timeout.ms": 6000}


@pytest.fixture(params=[*SINKS, "kafka"])
def any_sink(request: pytest.FixtureRequest, kafka: str, topic: str) -> Iterator[tuple[str, str]]:
    """(route URL, topic) on each sink."""
    if request.param == "kafka":
        yield f"kafka://{kafka}", topic
        return
    t = target(request.param)
    try:
        yield t.url(), t.topic
    finally:
        t.close()


def _config(pg_dsn: str, schema: str, **kw: Any) -> RelayConfig:
    base: dict[str, Any] = {"poll_interval": 0.1, "delivery_timeout": 5.0, "lease": 10.0}
    return RelayConfig(pg_dsn, schema=schema, **{**base, **kw})


def _factory(config: RelayConfig, *routes: str, **kw: Any) -> Any:
    return routed(parse_routes(list(routes), None), config.delivery_timeout, **kw)


def _insert_raw(dsn: str, schema: str, topic: str, key: str, headers: dict[str, str]) -> str:
    """A row as a writer's own SQL (or a release before the check) could store it."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            sql.SQL(
                "INSERT INTO {}.events (event_id, topic, key, payload, headers) "
                "VALUES (gen_random_uuid(), %s, %s, %s, %s::jsonb) RETURNING event_id::text"
            ).format(sql.Identifier(schema)),
            (topic, key.encode(), b"raw", json.dumps(headers)),
        ).fetchone()
    assert row is not None
    return str(row[0])


def _dead(dsn: str, schema: str) -> dict[str, str]:
    """event id -> error of every dead letter."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT event_id::text, error FROM {}.dead_letters").format(sql.Identifier(schema))
        ).fetchall()
    return {r[0]: r[1] for r in rows}


@pytest.mark.parametrize(
    "name",
    ["X\r\nNats-Rollup", "Transfer-Encoding ", "a b", "a:b", "outbox-claim-check", "Event-Id", "event-key"],
)
def test_enqueue_refuses_a_header_name_that_is_not_a_token_or_is_the_relays(
    pg_dsn: str, schema: str, name: str
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(ValueError, match=r"^headers: ") as err:
            outbox.enqueue(conn, "orders", b"x", headers={name: "v"}, schema=schema)
        assert repr(name) in str(err.value)
        outbox.enqueue(conn, "orders", b"fine", schema=schema)  # the transaction is still usable
        conn.commit()
    assert count(pg_dsn, schema, "events") == 1


def test_a_stored_row_with_a_bad_or_reserved_header_name_is_dead_lettered_on_every_sink(
    pg_dsn: str, schema: str, any_sink: tuple[str, str]
) -> None:
    """Rows written before the check, or by SQL of a writer's own: every sink dead-letters them
    at once (none retries, none sends a smuggled name), and the other keys' events go on.
    Before the check, NATS retried "X\\r\\nNats-Rollup" for ever (nats-py's BadHeaderError taken as
    transient), and Kafka sent a second event-id header that a consumer could read first."""
    url, topic = any_sink
    bad = {
        _insert_raw(pg_dsn, schema, topic, "a", {"X\r\nNats-Rollup": "all"}): "'X\\r\\nNats-Rollup'",
        _insert_raw(pg_dsn, schema, topic, "b", {"Transfer-Encoding ": "chunked"}): "'Transfer-Encoding '",
        _insert_raw(pg_dsn, schema, topic, "c", {"event-id": str(uuid.uuid4())}): "'event-id'",
        _insert_raw(pg_dsn, schema, topic, "d", {"outbox-claim-check": "postgres:x/y"}): "outbox-claim",
    }
    with psycopg.connect(pg_dsn) as conn:
        good = str(outbox.enqueue(conn, topic, b"good", key="e", headers={"tenant": "acme"}, schema=schema))
    config = _config(pg_dsn, schema, retry=RetryPolicy(base=0.2, cap=0.5, max_attempts=50))
    with running_relay(config, _factory(config, f"*={url}")):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="every row settled")
    dead = _dead(pg_dsn, schema)
    assert set(dead) == set(bad), dead
    for event_id, name in bad.items():
        assert dead[event_id].startswith("corrupt event row: headers: ") and name in dead[event_id]
    assert count(pg_dsn, schema, "delivered", f"event_id = '{good}'") == 1


def test_nats_headers_that_instruct_the_server_are_the_relays(pg_dsn: str, schema: str) -> None:
    """A writer's Nats-Rollup would purge the subject on a stream that allows rollups, and
    Nats-Expected-* or Nats-TTL would change what it keeps: dead-lettered, never published.
    A topic with a line break cannot smuggle a PUB line either (invalid_subject)."""
    sink = NatsTarget()
    try:
        asyncio.run(_allow_rollups(sink))
        evil = sink.topic.rsplit(".", 1)[0] + ".evil"
        with psycopg.connect(pg_dsn) as conn:
            for i in range(2):
                outbox.enqueue(conn, sink.topic, f"kept {i}".encode(), key="k", schema=schema)
            conn.commit()
            rollup = outbox.enqueue(
                conn, sink.topic, b"roll", key="r", headers={"Nats-Rollup": "sub"}, schema=schema
            )
            ttl = outbox.enqueue(conn, sink.topic, b"ttl", key="t", headers={"nats-ttl": "1s"}, schema=schema)
            smuggled = outbox.enqueue(
                conn, f"{sink.topic}\r\nPUB {evil} 5\r\nforged", b"x", key="s", schema=schema
            )
            conn.commit()
            after = outbox.enqueue(conn, sink.topic, b"after", key="k", schema=schema)
        config = _config(pg_dsn, schema)
        with running_relay(config, _factory(config, f"*={sink.url()}")):
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="every row settled")
            got = sink.read(3)
    finally:
        sink.close()
    assert [m.value for m in got] == [b"kept 0", b"kept 1", b"after"], "the stream lost nothing"
    assert not any(m.headers.get("x-subject", b"").endswith(b".evil") for m in got)
    dead = _dead(pg_dsn, schema)
    assert "header 'Nats-Rollup': Nats-* headers instruct the NATS server" in dead[str(rollup)]
    assert "header 'nats-ttl': Nats-* headers" in dead[str(ttl)]
    assert "is not a valid NATS subject" in dead[str(smuggled)]
    assert str(after) not in dead


async def _allow_rollups(sink: NatsTarget) -> None:
    nc = await nats.connect(sink.url())
    js = nc.jetstream()
    info = await js.stream_info(sink.stream)
    info.config.allow_rollup_hdrs = True
    await js.update_stream(info.config)
    await nc.close()


def test_a_webhook_receiver_gets_no_header_a_writer_named_for_it(pg_dsn: str, schema: str) -> None:
    """Authorization, Cookie, X-Original-URL and Host from a writer would be the receiver's own
    (or its proxy's) instructions: they arrive renamed as event-header-*, with trace context and
    the event's id and key under their own names."""
    sink = HttpTarget()
    headers = {
        "Authorization": "Bearer stolen",
        "Cookie": "session=s",
        "X-Original-URL": "/admin",
        "Host": "internal.example",
        "tenant": "acme",
        "traceparent": TRACEPARENT,
        "ce-partitionkey": "p1",
    }
    try:
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue(conn, sink.topic, {"n": 1}, key="k", headers=headers, schema=schema)
        config = _config(pg_dsn, schema)
        with running_relay(config, _factory(config, f"*={sink.url()}")):
            (got,) = sink.read(1)
        with sink.receiver.lock:
            (request,) = sink.accepted
    finally:
        sink.close()
    assert "authorization" not in request.headers and "cookie" not in request.headers
    assert "x-original-url" not in request.headers
    assert request.headers["host"].startswith("127.0.0.1:")
    assert request.headers["event-header-authorization"] == "Bearer stolen"
    assert request.headers["event-header-x-original-url"] == "/admin"
    assert request.headers["event-header-tenant"] == "acme"
    assert request.headers["traceparent"] == TRACEPARENT and request.headers["ce-partitionkey"] == "p1"
    assert request.headers["content-type"] == "application/json" and got.key == b"k"


def test_a_webhook_key_or_topic_cannot_move_the_request_path(pg_dsn: str, schema: str) -> None:
    """``{key}`` with ``..``, ``.``, ``a/../../admin`` or ``%2e%2e``: a receiver that normalises
    (or decodes, then normalises) the path would serve another resource. Dead-lettered; every
    request that arrives stays under the route's path."""
    sink = HttpTarget()
    bad_keys = ["..", ".", "a/../../admin", "%2e%2e", "%2E%2e%2F..%2Fadmin"]
    try:
        with psycopg.connect(pg_dsn) as conn:
            bad = {str(outbox.enqueue(conn, sink.topic, b"x", key=k, schema=schema)): k for k in bad_keys}
            bad_topic = str(outbox.enqueue(conn, "..", b"x", key="t", schema=schema))
            good = str(outbox.enqueue(conn, sink.topic, b"ok", key="a.b/c", schema=schema))
        config = _config(pg_dsn, schema)
        with running_relay(config, _factory(config, f"*={sink.url()}")):
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="every row settled")
        with sink.receiver.lock:
            requests = [r for r in sink.receiver.requests if r.method == "POST"]
    finally:
        sink.close()
    dead = _dead(pg_dsn, schema)
    assert all("segment of the webhook URL's path" in dead[e] and dead[e].startswith("the key") for e in bad)
    assert dead[bad_topic].startswith("the topic")
    assert good not in dead and [r.body for r in requests] == [b"ok"]
    for r in requests:
        for path in (r.path, unquote(r.path), unquote(unquote(r.path))):
            assert posixpath.normpath(path).startswith(sink.path + "/"), r.path


def test_each_webhook_receiver_verifies_only_its_own_secret(
    pg_dsn: str, schema: str, monkeypatch: Any
) -> None:
    """With one shared secret any receiver could sign requests that every other accepts.
    --webhook-secret-env gives each topic glob its receiver's own."""
    from standardwebhooks import Webhook, WebhookVerificationError

    from outbox.sinks.signing import parse_secret_envs

    a_secret = "whsec_" + base64.b64encode(b"partner-a-secret-of-24-bytes").decode()
    b_secret = "whsec_" + base64.b64encode(b"partner-b-secret-of-24-bytes").decode()
    shared = "whsec_" + base64.b64encode(b"the-shared-one-of-24-bytes").decode()
    monkeypatch.setenv("PARTNER_A_SECRET", a_secret)
    monkeypatch.setenv("PARTNER_B_SECRET", b_secret)
    a, b = HttpTarget(), HttpTarget()
    try:
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue(conn, "a.orders", {"to": "a"}, key="1", schema=schema)
            outbox.enqueue(conn, "b.orders", {"to": "b"}, key="2", schema=schema)
        config = _config(pg_dsn, schema)
        factory = _factory(
            config,
            f"a.*={a.url()}",
            f"b.*={b.url()}",
            webhook_secrets=parse_secrets(shared),
            webhook_secrets_for=parse_secret_envs(["a.*=PARTNER_A_SECRET b.*=PARTNER_B_SECRET"], os.environ),
        )
        with running_relay(config, factory):
            a.read(1)
            b.read(1)
        with a.receiver.lock, b.receiver.lock:
            (to_a,), (to_b,) = a.accepted, b.accepted
    finally:
        a.close()
        b.close()
    assert Webhook(a_secret).verify(to_a.body, to_a.headers) == {"to": "a"}
    assert Webhook(b_secret).verify(to_b.body, to_b.headers) == {"to": "b"}
    for secret, request in ((a_secret, to_b), (b_secret, to_a), (shared, to_a), (shared, to_b)):
        with pytest.raises(WebhookVerificationError):
            Webhook(secret).verify(request.body, request.headers)


def test_a_consumer_follows_claim_checks_only_into_its_own_store(
    pg_dsn: str, schema: str, kafka: str, topic: str, prefix: str
) -> None:
    """Whoever can produce to the topic chooses the reference. One into another schema (that the
    consumer's credentials can read), a malformed one and one into another bucket are refused
    one message at a time: the consumer neither reads them nor stops; the genuine one resolves."""
    other = f"{prefix}_other"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, other)
    secret_id = str(uuid.uuid4())
    theirs = PostgresStore(pg_dsn, other)
    theirs.put(secret_id, b"another tenant's payload")
    theirs.close()
    genuine_id = str(uuid.uuid4())
    mine = PostgresStore(pg_dsn, schema)
    mine.put(genuine_id, b"the big payload")
    mine.close()
    references = [
        f"postgres:{other}/{secret_id}",
        "postgres:",
        f"s3://someone-elses-bucket/{uuid.uuid4()}",
        b"\xff\xfe",
        f"postgres:{schema}/{genuine_id}",
    ]
    producer = Producer({"bootstrap.servers": kafka})
    for i, ref in enumerate(references):
        value = ref if isinstance(ref, bytes) else ref.encode()
        producer.produce(
            topic,
            b"",
            key=b"k",
            headers=[
                ("event-id", str(uuid.uuid4()).encode()),
                ("outbox-claim-check", value),
                ("n", str(i).encode()),
            ],
        )
    producer.flush(10)
    seen: list[tuple[str, bytes]] = []
    stop = threading.Event()

    def handler(conn: psycopg.Connection[Any], d: Delivery) -> None:
        seen.append((d.headers["n"].decode(), d.value))  # type: ignore[union-attr]
        stop.set()

    stats = consume_kafka(
        {"bootstrap.servers": kafka, "group.id": f"g-{topic}", **GROUP_SETTINGS},
        [topic],
        handler,
        dsn=pg_dsn,
        schema=schema,
        stop=stop,
        handle_signals=False,
    )
    assert seen == [("4", b"the big payload")]
    assert stats.refused == 4 and stats.failures == 0
    assert len(read_topic(kafka, topic, 5)) == 5
