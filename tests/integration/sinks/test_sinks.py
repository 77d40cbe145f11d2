"""Every sink beyond Kafka, against the real server: RabbitMQ, NATS JetStream, Redis Streams, webhooks.

Each test runs on each sink, with a destination of its own (tests/sink_servers.py).
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from outbox_bench.harness.proxy import Proxy

import outbox
from outbox.relay.config import RelayConfig
from outbox.relay.retry import RetryPolicy
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from outbox.sinks.signing import parse_secrets
from tests.helpers import (
    FAST,
    RelayProcess,
    assert_per_key_order,
    count,
    http_get,
    running_relay,
    wait_for,
    write_rounds,
)
from tests.sink_servers import SINKS, HttpTarget, Target, target

OUTAGE = 3.0  # seconds a sink stays down in the outage test
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(params=SINKS)
def sink(request: pytest.FixtureRequest) -> Iterator[Target]:
    t = target(request.param)
    try:
        yield t
    finally:
        t.close()


def _config(pg_dsn: str, schema: str, **kw: Any) -> RelayConfig:
    base: dict[str, Any] = {"poll_interval": 0.1, "delivery_timeout": 5.0, "lease": 10.0}
    return RelayConfig(pg_dsn, schema=schema, **{**base, **kw})


def _factory(config: RelayConfig, *routes: str, secrets: list[bytes] | None = None) -> Any:
    return routed(parse_routes(list(routes), None), config.delivery_timeout, webhook_secrets=secrets)


def test_delivers_byte_exact_and_never_a_rolled_back_event(pg_dsn: str, schema: str, sink: Target) -> None:
    payload = {"order": 42, "items": ["a", "ü"], "total": "9.99"}
    headers = {"content-type": "application/json", "traceparent": TRACEPARENT, "tenant": "acme"}
    with psycopg.connect(pg_dsn) as conn:
        committed = [
            outbox.enqueue(conn, sink.topic, payload, key="order-42", headers=headers, schema=schema),
            outbox.enqueue(conn, sink.topic, b"\x00\xffraw", key=None, schema=schema),
        ]
        conn.commit()
        outbox.enqueue(conn, sink.topic, b"rolled back", key="order-42", schema=schema)
        conn.rollback()
    config = _config(pg_dsn, schema)
    with running_relay(config, _factory(config, f"*={sink.url()}")):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 2, timeout=30, what="delivery")
        got = sink.read(2)
    # Different keys travel concurrently: arrival order between them is not promised.
    by_id = {m.event_id: m for m in got}
    assert sorted(by_id) == sorted(str(e) for e in committed) and len(got) == 2
    first, second = by_id[str(committed[0])], by_id[str(committed[1])]
    assert json.loads(first.value) == payload and first.key == b"order-42"
    for name, value in headers.items():
        # A webhook receiver gets a writer's own header names under event-header-.
        sent_as = f"event-header-{name}" if sink.scheme == "http" and name == "tenant" else name
        assert first.headers[sent_as] == value.encode(), name
    assert second.value == b"\x00\xffraw" and second.key is None
    assert all(b"rolled back" not in m.value for m in sink.fetch())
    if sink.scheme == "amqp":
        assert first.headers["x-message-id"] == first.headers["event-id"]
        assert first.headers["x-content-type"] == b"application/json"
        assert (
            first.headers["x-delivery-mode"] == b"2" and first.headers["x-routing-key"] == b"orders.created"
        )
    if sink.scheme == "nats":
        assert first.headers["Nats-Msg-Id"] == first.headers["event-id"]
    if sink.scheme == "http":
        assert first.headers["x-path"] == f"{sink.path}/orders.created/order-42".encode()  # type: ignore[attr-defined]
        assert first.headers["content-type"] == b"application/json"
        assert second.headers["content-type"] == b"application/octet-stream"
        assert second.headers["x-path"].endswith(b"/orders.created/")
    with psycopg.connect(pg_dsn) as conn:
        refs = conn.execute(f'SELECT sink_offset, sink_ref FROM "{schema}".delivered ORDER BY id').fetchall()
    in_order = [first, second]
    if sink.scheme == "redis":
        assert [r[1] for r in refs] == [m.headers["x-entry-id"].decode() for m in in_order]
    if sink.scheme == "nats":
        assert [r[0] for r in refs] == [m.offset for m in in_order]
        assert {r[1] for r in refs} == {sink.stream}  # type: ignore[attr-defined]


def test_a_binary_header_value_survives_where_the_protocol_allows_it(
    pg_dsn: str, schema: str, sink: Target
) -> None:
    """RabbitMQ (byte array) and Redis (JSON {"base64": ...}) keep it; NATS and HTTP headers are
    text, so the event is dead-lettered naming the header, and nothing else is held up."""
    with psycopg.connect(pg_dsn) as conn:
        odd = outbox.enqueue(conn, sink.topic, b"x", key="a", headers={"sig": b"\xff\x00"}, schema=schema)
        outbox.enqueue(conn, sink.topic, b"y", key="b", schema=schema)
    config = _config(pg_dsn, schema)
    with running_relay(config, _factory(config, f"*={sink.url()}")):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="drain")
    if sink.scheme in ("amqp",):
        got = {m.value: m for m in sink.read(2)}
        assert got[b"x"].headers["sig"] == b"\xff\x00"
    elif sink.scheme == "redis":
        raw = sink._client.xrange(sink.topic)[0][1][b"headers"]  # type: ignore[attr-defined]
        assert json.loads(raw)["sig"] == {"base64": "/wA="}
    else:
        assert [m.value for m in sink.read(1)] == [b"y"]
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute(f'SELECT event_id, error FROM "{schema}".dead_letters').fetchone()
        assert row is not None and row[0] == odd and "header 'sig'" in row[1]


@pytest.mark.slow
def test_per_key_order_through_failures_and_two_relay_processes(
    pg_dsn: str, schema: str, sink: Target
) -> None:
    keys, rounds = 50, 40  # 2,000 events, 5% of sends failing (half of them after the send)
    env = {"OUTBOX_TEST_FAILURE_RATE": "0.05"}
    opts = (*FAST, "--route", f"*={sink.url()}")
    relays = [
        RelayProcess(pg_dsn, schema, None, *opts, "--name", f"r{i}", env=env, module="tests.flaky_relay")
        for i in range(2)
    ]
    try:
        write_rounds(pg_dsn, schema, sink.topic, keys, rounds)
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=120, what="drain")
        for r in relays:
            assert r.stop() == 0, r.output()[-3000:]
        got = sink.read(keys * rounds)
    finally:
        # What the relays warned of (ownership lost, fencing), kept for a failure below.
        logs = "\n".join(
            f"r{i}: {line}" for i, r in enumerate(relays) for line in r.output().splitlines()
            if "WARNING" in line or "ERROR" in line
        )  # fmt: skip
        for r in relays:
            r.close()
    assert count(pg_dsn, schema, "delivered") == keys * rounds  # each archived once
    assert count(pg_dsn, schema, "delivered", "attempts > 1") > 0, "no failure was injected"
    assert len({m.event_id for m in got}) == keys * rounds
    try:
        assert_per_key_order(got)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nthe relays' warnings:\n{logs[-6000:]}") from None
    # Both relays delivered (the keys were shared out), and neither dead-lettered anything.
    assert count(pg_dsn, schema, "dead_letters") == 0


@pytest.mark.slow
def test_the_sink_down_for_a_while_then_back_loses_nothing(
    pg_dsn: str, schema: str, sink: Target, caplog: pytest.LogCaptureFixture
) -> None:
    """The server goes away (every connection reset, new ones refused) mid-stream and comes
    back; for webhooks the receiver also answers 503 for a while. Nothing is lost, each
    event is archived once, per-key order holds, and the outage is one line each way."""
    proxy = Proxy(*sink.server).start()
    keys, rounds = 20, 30
    retry = RetryPolicy(base=0.05, cap=0.5, max_attempts=1000)
    config = _config(pg_dsn, schema, delivery_timeout=2.0, lease=6.0, retry=retry)
    try:
        with running_relay(config, _factory(config, f"*={sink.url('127.0.0.1', proxy.port)}")) as relay:
            write_rounds(pg_dsn, schema, sink.topic, keys, rounds // 3)
            wait_for(lambda: count(pg_dsn, schema, "delivered") >= keys, timeout=30, what="flowing")
            proxy.refuse()
            write_rounds(pg_dsn, schema, sink.topic, keys, rounds // 3, rounds // 3)
            wait_for(lambda: relay.stats.retried > 0, timeout=30, what="failed attempts")
            time.sleep(OUTAGE)  # the fault's duration
            if isinstance(sink, HttpTarget):  # back, but failing
                sink.decide = lambda r: (503, {"retry-after": "0"}, b"busy")
                proxy.heal()
                time.sleep(OUTAGE)
                sink.decide = None
            else:
                proxy.heal()
            write_rounds(pg_dsn, schema, sink.topic, keys, rounds // 3, 2 * (rounds // 3))
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="drain after")
        got = sink.read(keys * rounds)
    finally:
        proxy.stop()
    assert count(pg_dsn, schema, "delivered") == keys * rounds
    assert len({m.event_id for m in got}) == keys * rounds
    assert_per_key_order(got)
    events = [getattr(r, "event", "") for r in caplog.records]
    outage = [e for e in events if e.startswith(f"{sink.scheme}.")]
    assert outage[0] == f"{sink.scheme}.started" and outage[-1] == f"{sink.scheme}.ended", outage
    assert outage.count(f"{sink.scheme}.started") <= 2, outage  # one outage (HTTP: down, then 503s)


def test_a_refused_event_is_dead_lettered_with_the_sinks_reason_and_parks_its_key(
    pg_dsn: str, schema: str, sink: Target
) -> None:
    """RabbitMQ: larger than the route's max_message_size; NATS: larger than the server's
    max_payload; Redis: the stream's key holds a string (WRONGTYPE); webhooks: HTTP 400."""
    url, payload, reason = sink.url(), b"x" * 2000, ""
    if sink.scheme == "amqp":
        url, reason = url + "&max_message_size=1000", "larger than max_message_size 1000"
    elif sink.scheme == "nats":
        payload, reason = b"x" * (2 * 1024 * 1024), "larger than the server's max_payload"
    elif sink.scheme == "redis":
        sink._client.set(sink.topic + "-refused", "a string")  # type: ignore[attr-defined]
        reason = "WRONGTYPE"
    else:
        assert isinstance(sink, HttpTarget)
        sink.decide = lambda r: (
            (400, {}, b"bad order: " + b"y" * 300) if r.body == payload else (200, {}, b"")
        )
        reason = "HTTP 400 from http://127.0.0.1"
    refused_topic = sink.topic + "-refused" if sink.scheme == "redis" else sink.topic
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, sink.topic, b"a1", key="a", schema=schema)
        refused = outbox.enqueue(conn, refused_topic, payload, key="a", schema=schema)
        outbox.enqueue(conn, sink.topic, b"a3", key="a", schema=schema)
        for i in range(5):
            outbox.enqueue(conn, sink.topic, f"b{i}".encode(), key="b", schema=schema)
    config = _config(pg_dsn, schema)
    with running_relay(config, _factory(config, f"*={url}")):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 6, timeout=30, what="the rest")
        wait_for(lambda: count(pg_dsn, schema, "dead_letters") == 1, timeout=30, what="the dead letter")
        with psycopg.connect(pg_dsn) as conn:
            error = conn.execute(f'SELECT event_id, error FROM "{schema}".dead_letters').fetchone()
            pending = conn.execute(f'SELECT payload FROM "{schema}".events').fetchall()
    assert error is not None and error[0] == refused and reason in error[1], error
    if sink.scheme == "http":
        assert error[1].endswith("bad order: " + "y" * 189)  # the first 200 bytes of the body
    assert [bytes(p[0]) for p in pending] == [b"a3"]  # parked behind its dead letter
    assert sorted(m.value for m in sink.read(6)) == [b"a1", *(f"b{i}".encode() for i in range(5))]


def test_webhook_signatures_verify_with_an_independent_implementation(pg_dsn: str, schema: str) -> None:
    """Standard Webhooks' own Python library checks every signature, under each of two
    rotated secrets; a wrong secret is refused. Bodies that are not UTF-8 (raw bytes) verify too,
    with the package's 1.3 and ``json_parse=False`` (docs/sinks.md)."""
    from standardwebhooks import Webhook, WebhookVerificationError

    old, new = (
        "whsec_" + base64.b64encode(b"old-secret-bytes-rotated-out").decode(),
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",
    )
    sink = HttpTarget()
    try:
        with psycopg.connect(pg_dsn) as conn:
            for i in range(20):
                outbox.enqueue(conn, sink.topic, {"n": i, "text": "é"}, key=f"k{i % 3}", schema=schema)
            for i in range(3):
                outbox.enqueue(conn, sink.topic, b"\xff\xfe raw " + bytes([i]), key="raw", schema=schema)
        config = _config(pg_dsn, schema)
        with running_relay(
            config, _factory(config, f"*={sink.url()}", secrets=parse_secrets(f"{old} {new}"))
        ):
            got = sink.read(23)
        with sink.receiver.lock:
            requests = list(sink.accepted)
    finally:
        sink.close()
    assert len(requests) == 23
    raw = [r for r in requests if r.body.startswith(b"\xff")]
    assert len(raw) == 3
    for r in raw:
        for secret in (old, new):
            assert Webhook(secret).verify(r.body, r.headers, json_parse=False) is None
    for r in [r for r in requests if r not in raw]:
        assert r.headers["webhook-id"] == r.headers["event-id"]
        assert abs(int(r.headers["webhook-timestamp"]) - time.time()) < 60
        assert len(r.headers["webhook-signature"].split(" ")) == 2
        for secret in (old, new):
            assert Webhook(secret).verify(r.body, r.headers)["n"] in range(20)
        with pytest.raises(WebhookVerificationError):
            Webhook("whsec_" + base64.b64encode(b"another-secret-of-24-bytes").decode()).verify(
                r.body, r.headers
            )
    assert len(got) == 23


def test_one_sink_down_leaves_the_other_routes_flowing_and_readyz_names_it(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    """RabbitMQ refused: Kafka and Redis routes keep delivering; /readyz is 503 naming the
    RabbitMQ sink while every sink has a line; then RabbitMQ is back and its events arrive.
    Each route has keys of its own: a key with events on RabbitMQ waits for them on every sink
    (the next test)."""
    rabbit, stream = target("amqp"), target("redis")
    proxy = Proxy(*rabbit.server).start()
    proxy.refuse()
    try:
        routes = (
            f"orders.*={rabbit.url('127.0.0.1', proxy.port)}",
            f"{stream.topic}={stream.url()}",
            f"*=kafka://{kafka}",
        )
        # No dead letters while RabbitMQ is refused, however slowly the other routes start.
        retry = RetryPolicy(base=0.05, cap=0.3, max_attempts=1000)
        config = _config(pg_dsn, schema, metrics_port=0, retry=retry)
        with psycopg.connect(pg_dsn) as conn:
            for i in range(50):
                outbox.enqueue(conn, "orders.created", f"o{i}".encode(), key=f"o{i % 5}", schema=schema)
                outbox.enqueue(conn, topic, f"t{i}".encode(), key=f"t{i % 5}", schema=schema)
                outbox.enqueue(conn, stream.topic, f"s{i}".encode(), key=f"s{i % 5}", schema=schema)
        with running_relay(config, _factory(config, *routes)) as relay:
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 100, timeout=30, what="kafka and redis")
            assert count(pg_dsn, schema, "delivered", "topic = 'orders.created'") == 0
            assert relay.http is not None
            status, body = http_get(relay.http.port, "/readyz")
            assert status == 503 and body.startswith("sink down: amqp://127.0.0.1"), body
            lines = body.splitlines()[1:]
            assert [line.split(" ")[1] for line in lines] == ["down:", "ok", "ok"], body
            proxy.heal()
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="rabbitmq back")
            wait_for(lambda: http_get(relay.http.port, "/readyz")[0] == 200, timeout=10, what="ready")
        assert sorted(m.value for m in rabbit.read(50)) == sorted(f"o{i}".encode() for i in range(50))
        assert len(stream.read(50)) == 50
    finally:
        proxy.stop()
        rabbit.close()
        stream.close()


def test_a_key_across_two_sinks_never_overtakes_its_failure_on_the_other(pg_dsn: str, schema: str) -> None:
    """A key's events alternate between a webhook and a Redis stream. The webhook refuses each
    event the first time (503), and the relay learns it after it has handed the batch's other
    events out: the key's next event, to Redis, waits for it all the same, and reaches Redis only
    after the webhook has taken the one before it."""
    hook, stream = HttpTarget(), target("redis")
    refused: set[bytes] = set()
    taken_at: dict[bytes, float] = {}

    def refuse_once(r: Any) -> tuple[int, dict[str, str], bytes]:
        if r.body not in refused:
            refused.add(r.body)
            return 503, {"retry-after": "0"}, b"not yet"
        taken_at[r.body] = time.time()
        return 204, {}, b""

    hook.decide = refuse_once
    keys, rounds = 5, 4
    try:
        with psycopg.connect(pg_dsn) as conn:
            for i in range(rounds):
                for k in range(keys):
                    topic = hook.topic if i % 2 == 0 else stream.topic
                    outbox.enqueue(conn, topic, f"k{k}:{i}".encode(), key=f"k{k}", schema=schema)
        config = _config(pg_dsn, schema, retry=RetryPolicy(base=0.2, cap=0.2, max_attempts=100))
        routes = (f"{hook.topic}={hook.url()}", f"*={stream.url()}")
        with running_relay(config, _factory(config, *routes)):
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="drain")
        entries = stream.read(keys * rounds // 2)
    finally:
        hook.close()
        stream.close()
    assert len(taken_at) == keys * rounds // 2 and count(pg_dsn, schema, "dead_letters") == 0
    for m in entries:
        k, i = m.value.decode().split(":")
        arrived_ms = int(m.headers["x-entry-id"].decode().split("-")[0])  # Redis's own clock
        before = taken_at[f"{k}:{int(i) - 1}".encode()]
        assert arrived_ms + 1 >= before * 1000, (
            f"{m.value!r} reached Redis {before * 1000 - arrived_ms:.0f} ms before the webhook took the key's event before it"
        )
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(f'SELECT key, delivered_at FROM "{schema}".delivered ORDER BY id').fetchall()
    for k in range(keys):
        times = [at for key, at in rows if key == f"k{k}".encode()]
        assert times == sorted(times), f"k{k} archived out of order"


def test_nats_replies_settle_each_event_no_stream_then_a_stream_and_a_stream_limit(
    pg_dsn: str, schema: str
) -> None:
    """The sink reads JetStream's replies itself: a subject no stream takes is retried (503
    no responders) and delivered once a stream takes it; a stream's own refusal (its
    max_msg_size, JetStream error 10054) is a dead letter; the stream's sequence is archived."""
    import nats
    import nats.js.errors

    from tests.sink_servers import NATS, _run

    prefix = f"q{uuid.uuid4().hex[:10]}"
    streams = {f"{prefix.upper()}A": f"{prefix}.later", f"{prefix.upper()}B": f"{prefix}.small"}

    async def admin(create: str | None, limit: str | None, drop: bool = False) -> None:
        nc = await nats.connect(f"nats://{NATS[0]}:{NATS[1]}")
        js = nc.jetstream()
        if create:
            await js.add_stream(name=create, subjects=[streams[create]])
        if limit:
            await js.add_stream(name=limit, subjects=[streams[limit]], max_msg_size=1000)
        if drop:
            for name in streams:
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    await js.delete_stream(name)
        await nc.close()

    later, small = streams.values()
    a, b = streams
    _run(admin(None, b))
    try:
        with psycopg.connect(pg_dsn) as conn:
            waits = [outbox.enqueue(conn, later, f"w{i}".encode(), key="w", schema=schema) for i in range(3)]
            big = outbox.enqueue(conn, small, b"x" * 2000, key="s", schema=schema)
            fits = outbox.enqueue(conn, small, b"fits", key="t", schema=schema)
        # The waiting events retry until the stream is made, however long the steps before take.
        config = _config(pg_dsn, schema, retry=RetryPolicy(base=0.05, cap=0.3, max_attempts=1000))
        with running_relay(config, _factory(config, f"*=nats://{NATS[0]}:{NATS[1]}")):
            wait_for(lambda: count(pg_dsn, schema, "dead_letters") == 1, timeout=30, what="the dead letter")
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 1, timeout=30, what="the small one")
            with psycopg.connect(pg_dsn) as conn:
                retried = conn.execute(
                    f'SELECT attempts, last_error FROM "{schema}".events WHERE event_id = %s', [waits[0]]
                ).fetchone()
            assert retried is not None and retried[0] >= 1, retried
            assert f"no JetStream stream of nats://{NATS[0]}:{NATS[1]} takes subject '{later}'" in retried[1]
            _run(admin(a, None))
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 4, timeout=30, what="after the stream")
        with psycopg.connect(pg_dsn) as conn:
            dead = conn.execute(f'SELECT event_id, error FROM "{schema}".dead_letters').fetchone()
            archived = conn.execute(
                f'SELECT event_id, sink_ref, sink_offset FROM "{schema}".delivered ORDER BY id'
            ).fetchall()
    finally:
        _run(admin(None, None, drop=True))
    assert dead is not None and dead[0] == big and "JetStream error 10054" in dead[1], dead
    assert [tuple(r) for r in archived] == [*((w, a, i + 1) for i, w in enumerate(waits)), (fits, b, 1)]


def test_a_webhook_receiver_that_hangs_is_a_timeout_retried_in_order(pg_dsn: str, schema: str) -> None:
    """The receiver holds its first request for longer than the delivery timeout: every
    request in flight then times out (retried, saying so), and once it answers again
    everything arrives, in order per key."""
    sink = HttpTarget()
    held = threading.Event()

    def hang_once(_: Any) -> tuple[int, dict[str, str], bytes]:
        if not held.is_set():
            held.set()
            time.sleep(1.5)  # the receiver's loop is stuck: no request is answered meanwhile
        return 204, {}, b""

    sink.decide = hang_once
    try:
        write_rounds(pg_dsn, schema, sink.topic, 3, 10)
        config = _config(pg_dsn, schema, delivery_timeout=0.5, retry=RetryPolicy(base=0.05, cap=0.2))
        errors: list[str] = []

        def timed_out() -> bool:
            with psycopg.connect(pg_dsn) as conn:
                rows = conn.execute(
                    f'SELECT last_error FROM "{schema}".events WHERE last_error IS NOT NULL'
                ).fetchall()
            errors[:] = [r[0] for r in rows]
            return bool(errors)

        with running_relay(config, _factory(config, f"*={sink.url()}")):
            wait_for(timed_out, timeout=30, what="timeouts")
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="drain")
        got = sink.read(30)
    finally:
        sink.close()
    assert all("did not answer within 0.5 s" in e for e in errors), errors
    assert len({m.event_id for m in got}) == 30
    assert_per_key_order(got)
