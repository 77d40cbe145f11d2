"""Metrics, health and tracing of the relay, against the real servers."""

from __future__ import annotations

import base64
import re
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

import outbox
from outbox.events import ClaimedEvent
from outbox.relay.relay import Relay, RelayConfig
from outbox.sinks.base import Outcome, Report, SinkWrapper
from outbox.sinks.kafka import KafkaSink
from tests.helpers import count, http_get, read_topic, running_relay, wait_for


def _sample(text: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (r"\{" + re.escape(want) + r"\}" if labels else "") + r" (\S+)$"
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.group(1))
    return None


def test_metrics_after_a_drain_match_what_was_delivered(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    other = topic + "-b"
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn, [{"topic": topic, "payload": b"x", "key": f"k{i}"} for i in range(300)], schema=schema
        )
        outbox.enqueue_many(conn, [{"topic": other, "payload": b"y"} for _ in range(200)], schema=schema)
        outbox.enqueue(conn, topic, b"z" * 2_000_000, key="big", schema=schema)
    config = RelayConfig(pg_dsn, schema=schema, metrics_port=0)
    with running_relay(config, bootstrap=kafka) as relay:
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30)
        assert relay.http is not None
        port = relay.http.port
        status, text = http_get(port, "/metrics")
    assert status == 200
    sink = f"kafka://{kafka}"  # the sink label: the scheme and the servers, never credentials
    D = "default"  # the outbox label: the --dsn/--schema outbox's name
    assert _sample(text, "outbox_events_delivered_total", outbox=D, topic=topic, sink=sink) == 300
    assert _sample(text, "outbox_events_delivered_total", outbox=D, topic=other, sink=sink) == 200
    assert _sample(text, "outbox_events_dead_total", outbox=D, topic=topic, sink=sink) == 1
    assert (
        _sample(
            text,
            "outbox_delivery_errors_total",
            outbox=D,
            topic=topic,
            sink=sink,
            error_type="MSG_SIZE_TOO_LARGE",
        )
        == 1
    )
    assert _sample(text, "outbox_delivery_latency_seconds_count", outbox=D, since="created") == 500
    assert (_sample(text, "outbox_batch_size_count", outbox=D) or 0) >= 1
    assert _sample(text, "outbox_oldest_pending_age_seconds", outbox=D) == 0
    assert (_sample(text, "outbox_table_bytes", outbox=D) or 0) > 0
    for name in ("outbox_table_dead_tuples", "outbox_oldest_xmin_age_seconds", "outbox_database_up"):
        assert _sample(text, name, outbox=D) is not None, name
    assert _sample(text, "outbox_owned_partitions", outbox=D) == 64
    assert _sample(text, "outbox_sink_replacements_total") == 0
    assert _sample(text, "outbox_partitions_lost_total", outbox=D) == 0


class SlowStartSlowAckSink(SinkWrapper):
    """Kafka sink that starts only when the test lets it, and holds its reports for 2 s,
    to watch /readyz change."""

    def __init__(self, bootstrap: str, started: threading.Event) -> None:
        assert started.wait(20), "the test never let the sink start"
        super().__init__(KafkaSink(bootstrap, delivery_timeout=10))
        self.held: list[tuple[float, Report, Outcome]] = []

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        release = time.monotonic() + 2.0
        return self.inner.produce(event, lambda o: self.held.append((release, report, o)))

    def poll(self, timeout: float) -> None:
        self.inner.poll(timeout)
        now = time.monotonic()
        due, self.held = [h for h in self.held if h[0] <= now], [h for h in self.held if h[0] > now]
        for _, report, outcome in due:
            report(outcome)


def test_readyz_goes_503_200_503_and_livez_stays_up(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    config = RelayConfig(pg_dsn, schema=schema, metrics_port=0, poll_interval=0.1, grace=10)
    may_start = threading.Event()
    relay = Relay(config, lambda: SlowStartSlowAckSink(kafka, may_start))
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    port = wait_for(lambda: relay.http.port if relay.http else None, timeout=10)
    assert relay.http is not None and relay.http.server.server_address[0] == "127.0.0.1"
    status, body = http_get(port, "/readyz")
    assert status == 503 and "starting" in body  # the sink is still starting
    may_start.set()
    wait_for(lambda: http_get(port, "/readyz")[0] == 200, timeout=20, what="ready")
    assert http_get(port, "/livez") == (200, "ok\n")
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, topic, b"in flight at shutdown", schema=schema)
    wait_for(lambda: relay.stats.claimed == 1, timeout=10)
    relay.stop()  # the event's report is held for 2 s: the relay drains meanwhile
    status, body = http_get(port, "/readyz")
    assert status == 503 and "draining" in body
    assert http_get(port, "/livez")[0] == 200
    thread.join(20)
    assert not thread.is_alive()
    assert count(pg_dsn, schema, "delivered") == 1


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process: the relay's tracer follows it
    yield exporter


def test_trace_continues_from_writer_through_relay_to_consumer(
    spans: InMemorySpanExporter, pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    spans.clear()
    tracer = trace.get_tracer("app")
    with psycopg.connect(pg_dsn) as conn, tracer.start_as_current_span("POST /orders") as request:
        writer_ctx = request.get_span_context()
        for i in range(3):
            outbox.enqueue(conn, topic, {"order": i}, key="c-1", schema=schema)
        # An explicit traceparent from the caller is kept as is.
        explicit = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        outbox.enqueue(conn, topic, {"order": 99}, headers={"traceparent": explicit}, schema=schema)
    with running_relay(RelayConfig(pg_dsn, schema=schema), bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 4, timeout=30)

    send = [s for s in spans.get_finished_spans() if s.name == f"send {topic}"]
    assert len(send) >= 1
    s = send[0]
    assert s.kind == SpanKind.PRODUCER
    assert s.attributes is not None
    assert s.attributes["messaging.system"] == "kafka"
    assert s.attributes["messaging.destination.name"] == topic
    assert s.attributes["messaging.operation.type"] == "send"
    assert s.attributes["outbox.name"] == "default"  # which outbox: its name, never a DSN
    assert sum(int(x.attributes["messaging.batch.message_count"]) for x in send) == 4  # type: ignore[index]
    linked = {link.context.trace_id for x in send for link in x.links}
    assert writer_ctx.trace_id in linked
    assert int("0af7651916cd43dd8448eb211c80319c", 16) in linked
    children = [
        c
        for c in spans.get_finished_spans()
        if c.parent is not None and c.parent.span_id == s.context.span_id
    ]
    assert {c.name for c in children} == {"claim", "ack"}

    # The consumer continues the writer's trace: the header is the writer's, not the relay's.
    by_order = {}
    for m in read_topic(kafka, topic, 4):
        by_order[m.value] = m.headers["traceparent"].decode()
    for i in range(3):
        tp = by_order[f'{{"order":{i}}}'.encode()]
        assert int(tp.split("-")[1], 16) == writer_ctx.trace_id
        assert int(tp.split("-")[2], 16) == writer_ctx.span_id
    assert by_order[b'{"order":99}'] == explicit


def test_send_span_records_error_type(
    spans: InMemorySpanExporter, pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    spans.clear()
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, topic, b"z" * 2_000_000, schema=schema)
    with running_relay(RelayConfig(pg_dsn, schema=schema), bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "dead_letters") == 1, timeout=30)
    send = [s for s in spans.get_finished_spans() if s.name == f"send {topic}"]
    assert send and send[0].attributes is not None
    assert send[0].attributes["error.type"] == "MSG_SIZE_TOO_LARGE"


def test_spans_of_each_sink_follow_its_conventions(
    spans: InMemorySpanExporter, pg_dsn: str, schema: str, kafka: str
) -> None:
    """RabbitMQ and NATS: messaging PRODUCER spans; Redis: a database CLIENT span; webhooks: an
    HTTP CLIENT span. Every one links the event's creation context and shows no credentials."""
    from outbox.sinks.make import routed
    from outbox.sinks.routes import parse_routes
    from tests.sink_servers import target

    targets = {scheme: target(scheme) for scheme in ("amqp", "nats", "redis", "http")}
    topics = {"amqp": "orders.created", "nats": targets["nats"].topic, "redis": targets["redis"].topic,
              "http": "hook.sent"}  # fmt: skip
    routes = [
        f"orders.*={targets['amqp'].url()}",
        f"{topics['nats']}={targets['nats'].url()}",
        f"{topics['redis']}={targets['redis'].url().replace('redis://', 'redis://:Pw-9@')}",
        f"hook.*={targets['http'].url().replace('http://', 'http://u:Pw-9@')}",
    ]
    spans.clear()
    tracer = trace.get_tracer("app")
    try:
        with psycopg.connect(pg_dsn) as conn, tracer.start_as_current_span("POST /orders") as request:
            writer = request.get_span_context()
            for t in topics.values():  # a key each: a failing route holds back its key's later events
                outbox.enqueue(conn, t, {"x": 1}, key=t, schema=schema)
        config = RelayConfig(pg_dsn, schema=schema)
        from outbox.sinks.signing import parse_secrets

        secrets = parse_secrets("whsec_" + base64.b64encode(b"observability-secret-bytes").decode())
        # Redis's default user takes any password: the URL's is sent, and must not be shown.
        with running_relay(
            config, routed(parse_routes(routes, None), config.delivery_timeout, webhook_secrets=secrets)
        ):
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 4, timeout=30, what="all delivered")
    finally:
        for t in targets.values():
            t.close()
    by_name = {
        s.name: s for s in spans.get_finished_spans() if s.kind in (SpanKind.PRODUCER, SpanKind.CLIENT)
    }
    amqp = by_name[f"send {targets['amqp'].exchange}"]  # type: ignore[attr-defined]
    assert amqp.kind == SpanKind.PRODUCER and amqp.attributes is not None
    assert amqp.attributes["messaging.system"] == "rabbitmq"
    assert amqp.attributes["messaging.rabbitmq.destination.routing_key"] == "orders.created"
    nats = by_name[f"send {topics['nats']}"]
    assert nats.kind == SpanKind.PRODUCER and nats.attributes is not None
    assert nats.attributes["messaging.system"] == "nats"
    redis = by_name[f"XADD {topics['redis']}"]
    assert redis.kind == SpanKind.CLIENT and redis.attributes is not None
    assert redis.attributes["db.system.name"] == "redis" and redis.attributes["db.operation.name"] == "XADD"
    http = by_name["POST"]
    assert http.kind == SpanKind.CLIENT and http.attributes is not None
    assert http.attributes["http.request.method"] == "POST"
    for span in (amqp, nats, redis, http):
        assert any(link.context.trace_id == writer.trace_id for link in span.links)
    for span in spans.get_finished_spans():
        assert "Pw-9" not in str(span.attributes) and "Pw-9" not in span.name
