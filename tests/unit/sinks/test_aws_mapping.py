"""The AWS sinks' pure parts: routes, attributes, FIFO ids, X-Ray trace headers, entries, errors."""

from __future__ import annotations

import json

import pytest

from outbox.errors import ConfigError
from outbox.events import ClaimedEvent
from outbox.sinks import aws, kinesis
from outbox.sinks.aio import Refused
from outbox.sinks.base import Dead, Retry
from outbox.sinks.routes import parse_url

TRACEPARENT = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def _event(
    payload: bytes = b'{"a":1}', key: bytes | None = b"k", headers: list[tuple[str, bytes]] | None = None
) -> ClaimedEvent:
    hs = [*(headers or []), ("event-id", b"0b7e1d3c-0000-4000-8000-000000000001")]
    return ClaimedEvent(
        1, "0b7e1d3c-0000-4000-8000-000000000001", "orders.created", key, payload, hs, 1.7e9, 0
    )


def test_routes_keep_the_names_case_and_refuse_credentials_and_bad_names() -> None:
    url = parse_url("sqs://Orders.fifo?region=eu-west-1", "--route")
    assert url.resource == "Orders.fifo" and url.display == "sqs://Orders.fifo?region=eu-west-1"
    with pytest.raises(ConfigError, match="never go in the URL") as err:
        parse_url("sqs://AKIA:s3cret@orders", "--route")
    assert "s3cret" not in str(err.value)
    with pytest.raises(ConfigError, match="expected kinesis://NAME"):
        parse_url("kinesis://bad name!", "--route")
    with pytest.raises(ConfigError, match="unknown option 'envelope'"):
        parse_url("sqs://q?envelope=json", "--route")


def test_a_route_is_checked_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_REGION", raising=False)
    monkeypatch.delenv("AWS_DEFAULT_REGION", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(ConfigError, match="no AWS region"):
        aws.SqsSink.check(parse_url("sqs://q", "r"), None)
    assert aws.SqsSink.check(parse_url("sqs://q?region=eu-west-1", "r"), None) == "eu-west-1"
    with pytest.raises(ConfigError, match="needs a Source"):
        aws.EventBridgeSink.check(parse_url("eventbridge://bus?region=eu-west-1", "r"), None)
    assert aws.EventBridgeSink.check(parse_url("eventbridge://bus?region=eu-west-1", "r"), "svc")
    with pytest.raises(ConfigError, match="envelope must be json"):
        kinesis.KinesisSink.check(parse_url("kinesis://s?region=eu-west-1&envelope=xml", "r"), None)


def test_attributes_put_ids_and_trace_first_and_fold_the_rest_into_one() -> None:
    many = [(f"h{i}", f"v{i}".encode()) for i in range(12)]
    odd = [("AWS.reserved", b"x"), ("bin", b"\xff\x00"), ("empty", b"")]
    attrs = aws.message_attributes(
        _event(headers=[*many, ("traceparent", TRACEPARENT), *odd]), body_base64=False
    )
    assert len(attrs) == aws.MAX_ATTRIBUTES
    assert list(attrs)[:4] == ["event-id", "event-topic", "event-key", "traceparent"]
    rest = json.loads(attrs[aws.OVERFLOW_ATTRIBUTE]["StringValue"])
    kept = {k: v["StringValue"] for k, v in attrs.items() if k != aws.OVERFLOW_ATTRIBUTE}
    every = {**kept, **{k: v for k, v in rest.items()}}
    for name, value in many:
        assert every[name] == value.decode()
    assert rest["AWS.reserved"] == "x" and rest["bin"] == {"base64": "/wA="} and rest["empty"] == ""
    few = aws.message_attributes(_event(payload=b"\xff", key=None), body_base64=True)
    assert few[aws.ENCODING_ATTRIBUTE]["StringValue"] == "base64" and "event-key" not in few
    assert aws.OVERFLOW_ATTRIBUTE not in few


def test_sqs_text_fifo_ids_and_xray_headers() -> None:
    assert (
        aws.sqs_text("ü€".encode()) == "ü€"
        and aws.sqs_text(b"\x00a") is None
        and aws.sqs_text(b"\xff") is None
    )
    assert aws.fifo_id(b"order-42") == "order-42"
    lookalike = aws.fifo_id(b"\xff").encode()  # a text key shaped like another key's group: digested
    assert aws.fifo_id(lookalike) != lookalike.decode() and aws.fifo_id(lookalike).startswith("sha256-")
    assert aws.fifo_id("ü".encode()).startswith("sha256-") and aws.fifo_id(b"x" * 200) == aws.fifo_id(
        b"x" * 200
    )
    assert (
        aws.xray_trace_header(TRACEPARENT)
        == "Root=1-4bf92f35-77b34da6a3ce929d0e0e4736;Parent=00f067aa0ba902b7;Sampled=1"
    )
    assert aws.xray_trace_header(b"garbage") is None and aws.xray_trace_header(None) is None


def test_entries_of_each_service() -> None:
    source = parse_url("eventbridge://bus?region=eu-west-1&source=orders", "r")
    bus = aws.EventBridgeSink.__new__(aws.EventBridgeSink)
    bus.source, bus.resource = "orders", source.resource
    entry = bus.entry(_event(headers=[("traceparent", TRACEPARENT)]))
    assert entry.body["Detail"] == '{"a":1}' and entry.body["DetailType"] == "orders.created"
    assert entry.body["Resources"] == ["urn:uuid:0b7e1d3c-0000-4000-8000-000000000001"]
    assert entry.body["TraceHeader"].startswith("Root=1-4bf92f35-")
    for payload in (b"[1,2]", b"not json", b"\xff"):
        with pytest.raises(Refused, match="JSON object"):
            bus.entry(_event(payload=payload))
    stream = kinesis.KinesisSink.__new__(kinesis.KinesisSink)
    stream.envelope = False
    assert (
        stream.entry(_event(payload=b"\xff", key=None)).body["PartitionKey"]
        == "0b7e1d3c-0000-4000-8000-000000000001"
    )
    stream.envelope = True
    body = json.loads(stream.entry(_event(payload=b"\xff")).body["Data"])
    assert body["payload_base64"] == "/w==" and body["key"] == "k" and body["id"].startswith("0b7e1d3c")


def test_entry_failures_are_retried_or_dead_by_the_services_answer() -> None:
    sink = aws.SqsSink.__new__(aws.SqsSink)
    sink.name, sink._secrets = "sqs://q", []
    assert isinstance(sink.entry_failure("ThrottlingException", "slow down", True), Retry)
    assert isinstance(sink.entry_failure("InternalError", "oops", False), Retry)
    dead = sink.entry_failure("InvalidParameterValue", "bad attribute", True)
    assert isinstance(dead, Dead) and dead.kind == "InvalidParameterValue" and "bad attribute" in dead.reason
    settled = sink.settle(
        {
            "Successful": [{"Id": "1", "MessageId": "m1"}],
            "Failed": [{"Id": "0", "Code": "X", "SenderFault": True}],
        },
        3,
    )
    assert isinstance(settled[0], Dead) and settled[1].ref == "m1" and isinstance(settled[2], Retry)  # type: ignore[union-attr]
