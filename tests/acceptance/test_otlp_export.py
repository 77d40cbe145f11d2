"""Traces through the real OTLP/HTTP exporter: ``outbox relay`` (a process) started with
``OTEL_EXPORTER_OTLP_ENDPOINT`` pointing at a receiver this test runs, which decodes the
protobuf with ``opentelemetry-proto``. Checked: the span names, kinds and attributes, the links
to the spans that wrote the events, and that no secret (the DSN's password) is in any
attribute or resource value."""

from __future__ import annotations

import http.server
import threading
import time
from typing import Any

import psycopg
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.trace.v1.trace_pb2 import Span
from opentelemetry.sdk.trace import TracerProvider
from psycopg.conninfo import make_conninfo

import outbox
from tests.helpers import RelayProcess, count, wait_for

SECRET = "otlp-test-s3cret"  # the DSN's password: trust auth ignores it, the relay must never show it


class Receiver:
    """An OTLP/HTTP trace receiver on a loopback port: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.requests: list[ExportTraceServiceRequest] = []
        self.paths: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                outer.requests.append(request)
                outer.paths.append(self.path)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[dict[str, str], Span]]:
        """(resource attributes, span) of everything received."""
        out = []
        for request in list(self.requests):
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                out.extend((resource, span) for ss in rs.scope_spans for span in ss.spans)
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attrs(span: Span) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for a in span.attributes:
        v = a.value
        out[a.key] = v.string_value if v.HasField("string_value") else v.int_value
    return out


def test_the_relay_exports_its_spans_over_otlp_http(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    writer_tracer = TracerProvider().get_tracer("orders-app")
    writer_spans = []
    with psycopg.connect(pg_dsn) as conn:
        for i in range(5):
            with writer_tracer.start_as_current_span(f"POST /orders/{i}") as span:
                outbox.enqueue(conn, topic, {"order": i}, key=f"o{i}", schema=schema)
                writer_spans.append(span.get_span_context())
        conn.commit()
    receiver = Receiver()
    env = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_BSP_SCHEDULE_DELAY": "200",
        "OTEL_SERVICE_NAME": "outbox-relay-under-test",
    }
    dsn = make_conninfo(pg_dsn, password=SECRET)
    try:
        with RelayProcess(dsn, schema, kafka, env=env) as relay:
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 5, timeout=60, what="delivery")
            wait_for(
                lambda: any(s.name == f"send {topic}" for _, s in receiver.spans()),
                timeout=30,
                what="the batch span at the receiver",
            )
            assert relay.stop() == 0, relay.output()
            time.sleep(0.5)
    finally:
        receiver.close()
    assert set(receiver.paths) == {"/v1/traces"}
    spans = receiver.spans()
    sends = [(r, s) for r, s in spans if s.name == f"send {topic}"]
    assert sends, [s.name for _, s in spans]
    resource, send = sends[0]
    assert resource["service.name"] == "outbox-relay-under-test"
    assert send.kind == Span.SPAN_KIND_PRODUCER
    attrs = _attrs(send)
    assert attrs["messaging.system"] == "kafka"
    assert attrs["messaging.destination.name"] == topic
    assert attrs["messaging.operation.type"] == "send"
    assert sum(_attrs(s).get("messaging.batch.message_count", 0) for _, s in sends) == 5
    linked = {(link.trace_id.hex(), link.span_id.hex()) for _, s in sends for link in s.links}
    written = {(f"{c.trace_id:032x}", f"{c.span_id:016x}") for c in writer_spans}
    assert linked == written, "each batch span links to the spans that wrote its events"
    children = {s.name for _, s in spans if s.parent_span_id == send.span_id}
    assert {"claim", "ack"} <= children
    for r, s in spans:  # no secret anywhere in what left the process
        values = [str(v) for v in _attrs(s).values()] + list(r.values()) + [s.name]
        assert not [v for v in values if SECRET in v], s.name
