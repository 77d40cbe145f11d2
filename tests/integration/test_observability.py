"""Metrics, health and tracing of the relay, against the real servers."""

from __future__ import annotations

import re
import threading
import time
import urllib.error
import urllib.request
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
from outbox.relay import Relay, RelayConfig
from outbox.sinks.base import Outcome, Report, SinkWrapper
from outbox.sinks.kafka import KafkaSink
from tests.helpers import count, read_topic, running_relay, wait_for


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


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
        assert relay._health is not None
        port = relay._health.port
        status, text = _get(port, "/metrics")
    assert status == 200
    assert _sample(text, "outbox_events_delivered_total", topic=topic) == 300
    assert _sample(text, "outbox_events_delivered_total", topic=other) == 200
    assert _sample(text, "outbox_events_dead_total", topic=topic) == 1
    assert _sample(text, "outbox_delivery_errors_total", topic=topic, error_type="MSG_SIZE_TOO_LARGE") == 1
    assert _sample(text, "outbox_delivery_latency_seconds_count") == 500
    assert (_sample(text, "outbox_batch_size_count") or 0) >= 1
    assert _sample(text, "outbox_oldest_pending_age_seconds") == 0
    assert (_sample(text, "outbox_table_bytes") or 0) > 0
    for name in ("outbox_table_dead_tuples", "outbox_oldest_xmin_age_seconds", "outbox_database_up"):
        assert _sample(text, name) is not None, name
    assert _sample(text, "outbox_owned_partitions") == 64


class SlowStartSlowAckSink(SinkWrapper):
    """Kafka sink that starts slowly and holds its first reports, to watch /readyz change."""

    def __init__(self, bootstrap: str) -> None:
        time.sleep(1.0)
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
    relay = Relay(config, lambda: SlowStartSlowAckSink(kafka))
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    port = wait_for(lambda: relay._health.port if relay._health else None, timeout=10)
    assert relay._health is not None and relay._health.server.server_address[0] == "127.0.0.1"
    codes = [_get(port, "/readyz")[0]]
    assert codes[0] == 503  # the sink is still starting
    wait_for(lambda: _get(port, "/readyz")[0] == 200, timeout=20, what="ready")
    assert _get(port, "/livez") == (200, "ok\n")
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, topic, b"in flight at shutdown", schema=schema)
    wait_for(lambda: relay.stats.claimed == 1, timeout=10)
    relay.stop()  # the event's report is held for 2 s: the relay drains meanwhile
    status, body = _get(port, "/readyz")
    assert status == 503 and "draining" in body
    assert _get(port, "/livez")[0] == 200
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


def test_secrets_never_reach_logs_errors_status_or_metrics(pg_dsn: str, schema: str, kafka: str) -> None:
    """A DSN password and a SASL password, with errors provoked on both sides."""
    import os
    import signal
    import subprocess
    import sys
    import urllib.error
    import urllib.request

    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    from outbox.embedded import free_port
    from tests.helpers import RelayProcess

    pw, sasl = "PgSecret-7f3a", "SaslSecret-91bc"
    port = free_port()
    dsn = make_conninfo(**{**conninfo_to_dict(pg_dsn), "password": pw})  # trust auth ignores it
    relay = RelayProcess(
        dsn,
        schema,
        "127.0.0.1:1",  # no broker there: connection errors are logged
        "--kafka-config",
        "security.protocol=SASL_PLAINTEXT",
        "--kafka-config",
        "sasl.mechanism=PLAIN",
        "--kafka-config",
        "sasl.username=u",
        "--kafka-config",
        f"sasl.password={sasl}",
        "--metrics-port",
        str(port),
        "--log-level",
        "debug",
    )
    scraped = []
    try:
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue(conn, "t", b"x", schema=schema)
        time.sleep(4)
        for path in ("/metrics", "/readyz", "/livez"):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
                    scraped.append(resp.read().decode())
            except urllib.error.HTTPError as exc:  # /readyz is 503 while the broker is unreachable
                scraped.append(exc.read().decode())
        relay.proc.send_signal(signal.SIGTERM)
        relay.proc.wait(30)
        logs = relay.output()
    finally:
        relay.close()
    assert "delivery" in logs.lower() or "kafka" in logs.lower(), logs[-1000:]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    status = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--dsn", dsn, "--schema", schema],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "outbox",
            "status",
            "--schema",
            schema,
            "--dsn",
            dsn.replace("dbname=", "dbname=nope_"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode != 0
    assert "outbox_events_delivered_total" in scraped[0] or "outbox_" in scraped[0], scraped[0][:500]
    for text in (logs, status.stdout, status.stderr, bad.stdout, bad.stderr, *scraped):
        assert pw not in text and sasl not in text


def test_secrets_never_reach_the_output_of_any_cli_command(pg_dsn: str, schema: str, kafka: str) -> None:
    """Every command, with the password in keyword and URL DSNs, working and failing."""
    import os
    import subprocess
    import sys

    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    pw, sasl = "PgSecret-c41d", "SaslSecret-0e27"
    parts = conninfo_to_dict(pg_dsn)
    good = make_conninfo(**{**parts, "password": pw})  # trust auth ignores the password
    url = f"postgresql://{parts.get('user', 'root')}:{pw}@{parts.get('host', '127.0.0.1')}:{parts.get('port', 5432)}"
    broken = [
        f"{url}/nope_db",
        make_conninfo(**{**parts, "password": pw, "dbname": "nope_db"}),
        f"{url}x/test",
    ]
    sasl_args = ["--kafka-config", "security.protocol=SASL_PLAINTEXT", "--kafka-config", "sasl.mechanism=PLAIN",
                 "--kafka-config", "sasl.username=u", "--kafka-config", f"sasl.password={sasl}"]  # fmt: skip
    commands = [
        ["migrate"],
        ["status"],
        ["status", "--json"],
        ["dead", "list"],
        ["dead", "redrive", "--all", "--dry-run"],
        ["retry", "--dry-run"],
        ["replay", "--since", "1h", "--dry-run"],
        ["replay", "--since", "1h", "--yes"],
        [
            "replay",
            "--since",
            "1h",
            "--typo",
            "--kafka-bootstrap",
            "127.0.0.1:1",
            *sasl_args,
        ],  # argparse error
        ["purge", "--older-than", "30d", "--dry-run"],
        ["notify", "on"],
        ["relay", "--kafka-bootstrap", "127.0.0.1:1", "--grace", "0", *sasl_args],
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    outputs = []
    failures = 0
    for dsn in [good, *broken]:
        for command in commands:
            try:
                out = subprocess.run(
                    [sys.executable, "-m", "outbox", *command, "--dsn", dsn, "--schema", schema],
                    capture_output=True, text=True, env=env, timeout=15,
                )  # fmt: skip
                failures += out.returncode != 0
                outputs.append((command, dsn, out.stdout + out.stderr))
            except subprocess.TimeoutExpired as exc:  # the relay runs until stopped: what it said so far
                text = (exc.stdout or b"") + (exc.stderr or b"")
                outputs.append((command, dsn, text.decode() if isinstance(text, bytes) else text))
    # With env DSN too (OUTBOX_DSN), as a sidecar would be configured.
    out = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--schema", schema],
        capture_output=True, text=True, env={**env, "OUTBOX_DSN": broken[0]}, timeout=15,
    )  # fmt: skip
    outputs.append((["status (OUTBOX_DSN)"], broken[0], out.stdout + out.stderr))
    assert failures >= 3 * len(commands) - 3, "the broken DSNs should make (nearly) every command fail"
    assert any("nope_db" in text for _, _, text in outputs), "errors should still say what is wrong"
    for command, dsn, text in outputs:
        assert pw not in text and sasl not in text, (command, dsn, text[-2000:])
