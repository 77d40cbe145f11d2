"""OpenTelemetry spans of the relay, after the messaging semantic conventions.

One span per sent batch and topic. For Kafka (and RabbitMQ, NATS, with their
own ``messaging.system``), ``send <topic>``, kind PRODUCER, with
``messaging.system=kafka``, ``messaging.destination.name``,
``messaging.operation.type=send``, ``messaging.batch.message_count``,
``error.type`` when events failed, and a link to each event's creation context
(the ``traceparent`` stored by ``enqueue``). The claim and the ack appear as its
child spans. The stored ``traceparent`` itself travels to Kafka unchanged: the
relay never injects its own context into messages, so the consumer continues the
trace that wrote the event.

Nothing is recorded unless an OpenTelemetry SDK tracer provider is installed
(``outbox relay`` installs one from the standard ``OTEL_*`` variables); the
per-event work (parsing ``traceparent`` for links) is skipped otherwise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from outbox.errors import ConfigError, MissingExtra
from outbox.events import ClaimedEvent

_tracer = trace.get_tracer("outbox")
_propagator = TraceContextTextMapPropagator()
MAX_LINKS = 128  # the SDK's default span link limit


def _link(event: ClaimedEvent) -> Link | None:
    carrier: dict[str, str] = {}
    for name, value in event.headers:
        if name in ("traceparent", "tracestate") and isinstance(value, bytes):
            carrier[name] = value.decode("latin-1")
    if "traceparent" not in carrier:
        return None
    ctx = trace.get_current_span(_propagator.extract(carrier)).get_span_context()
    return Link(ctx) if ctx.is_valid else None


def tracing_on() -> bool:
    """False until a real tracer provider is installed (the API default records nothing)."""
    return not isinstance(trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider))


def kafka_shape(topic: str) -> tuple[str, dict[str, Any]]:
    return f"send {topic}", {
        "messaging.system": "kafka",
        "messaging.destination.name": topic,
        "messaging.operation.type": "send",
        "messaging.operation.name": "send",
    }


def start_batch(
    events: Sequence[ClaimedEvent | None],
    claim_start_ns: int,
    claim_end_ns: int,
    shape: Callable[[str], tuple[str, dict[str, Any]]] = kafka_shape,
) -> dict[str, Span]:
    """One span per topic of a claimed batch (empty when tracing is off).

    ``shape(topic)`` gives the span's name and attributes, after the conventions of the
    topic's sink: messaging (Kafka, RabbitMQ, NATS; kind PRODUCER), database (Redis;
    kind CLIENT) or HTTP client (webhooks; kind CLIENT)."""
    if not tracing_on():
        return {}  # before any per-event work: this runs for every batch
    by_topic: dict[str, list[ClaimedEvent]] = {}
    for event in events:
        if event is not None:
            by_topic.setdefault(event.topic, []).append(event)
    spans: dict[str, Span] = {}
    for topic, topic_events in by_topic.items():
        links = [link for link in map(_link, topic_events[:MAX_LINKS]) if link is not None]
        name, attributes = shape(topic)
        messaging = "messaging.system" in attributes
        if messaging:
            attributes = {**attributes, "messaging.batch.message_count": len(topic_events)}
        span = _tracer.start_span(
            name,
            kind=SpanKind.PRODUCER if messaging else SpanKind.CLIENT,
            start_time=claim_start_ns,
            links=links,
            attributes=attributes,
        )
        if not span.is_recording():
            span.end()
            return {}
        claim = _tracer.start_span(
            "claim", context=trace.set_span_in_context(span), start_time=claim_start_ns
        )
        claim.end(end_time=claim_end_ns)
        spans[topic] = span
    return spans


def end_batch(
    spans: dict[str, Span],
    errors: dict[str, str],
    ack_start_ns: int,
    ack_end_ns: int,
    ack_error: str | None = None,
) -> None:
    """Close a batch's spans: ``errors`` maps a topic to its first failure's error type."""
    for topic, span in spans.items():
        ack = _tracer.start_span("ack", context=trace.set_span_in_context(span), start_time=ack_start_ns)
        if ack_error is not None:
            ack.set_attribute("error.type", ack_error)
            ack.set_status(StatusCode.ERROR, ack_error)
        ack.end(end_time=ack_end_ns)
        error = errors.get(topic) or ack_error
        if error is not None:
            span.set_attribute("error.type", error)
            span.set_status(StatusCode.ERROR, error)
        span.end(end_time=ack_end_ns)


def configure_from_env() -> bool:
    """Install an SDK tracer provider when the standard OTEL_* variables ask for export.

    ``OTEL_TRACES_EXPORTER`` = ``otlp`` (needs ``pip install 'outbox-relay[otlp]'``) or
    ``console``; an ``OTEL_EXPORTER_OTLP_*ENDPOINT`` alone means ``otlp``.
    Service name and resource come from ``OTEL_SERVICE_NAME`` /
    ``OTEL_RESOURCE_ATTRIBUTES``. Returns whether tracing was switched on.
    """
    exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if not exporter_name and (
        os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    ):
        exporter_name = "otlp"
    if exporter_name in ("", "none"):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    exporter: SpanExporter
    if exporter_name == "console":
        exporter = ConsoleSpanExporter()
    elif exporter_name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise MissingExtra("OTEL_TRACES_EXPORTER=otlp", "otlp") from None
        exporter = OTLPSpanExporter()
    else:
        raise ConfigError(f"OTEL_TRACES_EXPORTER: {exporter_name!r} is not supported (otlp, console, none)")
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "outbox-relay")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    return True
