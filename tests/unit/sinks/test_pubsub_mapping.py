"""The Pub/Sub sink's mapping, pure logic: its URL, the ordering key and the attributes within
Pub/Sub's limits (which the emulator does not check)."""

from __future__ import annotations

import json
import time

import pytest

from outbox.errors import ConfigError
from outbox.events import ClaimedEvent
from outbox.sinks.aio import Refused
from outbox.sinks.pubsub import MAX_ATTRIBUTES, OVERFLOW_ATTRIBUTE, attributes, ordering_key
from outbox.sinks.routes import parse_routes

ID = "6f0c3b9e-58a4-4b8e-9d53-2b1f9ad0b6a1"


def _event(headers: list[tuple[str, str | bytes | None]], key: bytes | None = b"k") -> ClaimedEvent:
    return ClaimedEvent(1, ID, "orders", key, b"{}", [*headers, ("event-id", ID.encode())], 0.0, 0)


def test_a_route_names_a_project_and_a_topic() -> None:
    (route,) = parse_routes(
        ["*=pubsub://my-project/orders.v1?endpoint=europe-west1-pubsub.googleapis.com:443"], None
    )
    assert (
        route.url.display == "pubsub://my-project/orders.v1?endpoint=europe-west1-pubsub.googleapis.com:443"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("pubsub://my-project", "expected pubsub://PROJECT/TOPIC"),
        ("pubsub://My_Project/orders", "expected pubsub://PROJECT/TOPIC"),
        ("pubsub://my-project/goog-orders", "not with goog"),
        ("pubsub://my-project/1orders", "starting with a letter"),
        ("pubsub://user:secret@my-project/orders", "credentials never go in the URL"),
        ("pubsub://my-project/orders?region=x", "unknown option 'region'"),
    ],
)
def test_a_bad_url_is_one_error_naming_the_route(url: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_routes([f"*={url}"], None)
    assert message in str(caught.value) and "secret" not in str(caught.value)


def test_the_ordering_key_is_the_key_or_a_digest_of_it() -> None:
    assert ordering_key(None) == ("", True)
    assert ordering_key(b"customer-7") == ("customer-7", True)
    digest, itself = ordering_key(b"\xff")
    assert digest.startswith("sha256-") and not itself
    long, itself = ordering_key(b"k" * 1025)  # over 1,024 bytes: a digest, the same every time
    assert long.startswith("sha256-") and not itself and ordering_key(b"k" * 1025)[0] == long


def test_no_text_key_names_another_keys_digest() -> None:
    """A writer's text key ``sha256-<hex>`` was its own ordering key, the very one another writer's
    binary key got as its digest: a failure of one paused the other's events (issue 70)."""
    binary = ordering_key(b"\xff\xfe")[0]
    lookalike, itself = ordering_key(binary.encode())
    assert lookalike != binary and not itself and lookalike.startswith("sha256-")


def test_a_key_too_long_for_an_attribute_is_sent_as_its_digest_alone() -> None:
    event = _event([("tenant", b"acme")], key=b"L" * 2000)
    _, itself = ordering_key(event.key)
    out = attributes(event, itself)
    assert "event-key" not in out and OVERFLOW_ATTRIBUTE not in out and out["tenant"] == "acme"
    short = attributes(_event([], key=b"\xfe"), False)  # one that fits still goes with it
    assert json.loads(short[OVERFLOW_ATTRIBUTE]) == {"event-key": {"base64": "/g=="}}


def test_headers_pubsub_cannot_take_go_into_one_json_attribute() -> None:
    event = _event(
        [("tenant", b"acme"), ("goog-x", b"1"), ("bin", b"\xff"), ("n" * 300, b"v"), ("big", b"v" * 1025)],
        key=b"\xfe",
    )
    with pytest.raises(Refused) as caught:  # 1,025 bytes of one value cannot fit in the overflow either
        attributes(event, False)
    assert caught.value.kind == "invalid_attributes"
    event = _event([("tenant", b"acme"), ("goog-x", b"1"), ("bin", b"\xff"), ("n" * 300, b"v")], key=b"\xfe")
    out = attributes(event, False)
    assert out["event-id"] == ID and out["tenant"] == "acme"
    assert json.loads(out[OVERFLOW_ATTRIBUTE]) == {
        "event-key": {"base64": "/g=="},
        "goog-x": "1",
        "bin": {"base64": "/w=="},
        "n" * 300: "v",
    }


def test_past_the_hundredth_attribute_the_rest_overflow() -> None:
    out = attributes(_event([(f"h{i}", b"v") for i in range(120)]), True)
    assert len(out) == MAX_ATTRIBUTES
    assert len(json.loads(out[OVERFLOW_ATTRIBUTE])) == 120 - (MAX_ATTRIBUTES - 2)


def test_an_unreachable_service_is_an_outage_only_when_nothing_got_through_for_a_moment() -> None:
    """Each publish is one attempt: Pub/Sub's passing UNAVAILABLE among publishes that get
    through is that event's retry, not an outage (which drops the publisher and fails everything
    in flight); refused or unanswered attempts with nothing confirmed for QUIET s are one."""
    from google.api_core import exceptions as gexc

    from outbox.sinks.base import Retry
    from outbox.sinks.pubsub import QUIET, PubSubSink

    (route,) = parse_routes(["*=pubsub://my-project/orders"], None)
    sink = PubSubSink(route.url, timeout=2.0)
    try:
        sink.confirmed()
        for exc in (gexc.ServiceUnavailable("try again"), gexc.DeadlineExceeded("slow")):
            outcome = sink.failure(exc)
            assert isinstance(outcome, Retry) and outcome.kind == "unavailable", outcome
            assert not sink.condition.active, "a passing error took the sink down"
        time.sleep(QUIET)
        outcome = sink.failure(gexc.ServiceUnavailable("failed to connect to all addresses"))
        assert isinstance(outcome, Retry) and sink.condition.active
        assert "failed to connect" in sink.condition.last_error
        sink.confirmed()
        assert not sink.condition.active
        sink.failure(gexc.NotFound("topic"))  # no topic: down at once, whatever got through
        assert sink.condition.active and "the topic does not exist" in sink.condition.last_error
    finally:
        sink.close(1)


def test_a_batch_the_publisher_cancelled_is_retried_without_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """After a failed publish the publisher cancels the key's later batches, and a stopped one
    its queued batches, each with a RuntimeError saying why (its own text: this test reads it
    from google-cloud-pubsub, so that a new wording fails here, not as a warning an event)."""
    from google.cloud.pubsub_v1.publisher._batch.base import BatchCancellationReason

    from outbox.sinks.base import Retry
    from outbox.sinks.pubsub import PAUSED, PubSubSink

    (route,) = parse_routes(["*=pubsub://my-project/orders"], None)
    sink = PubSubSink(route.url, timeout=2.0)
    try:
        prior = sink.failure(RuntimeError(BatchCancellationReason.PRIOR_ORDERED_MESSAGE_FAILED.value))
        stopped = sink.failure(RuntimeError(BatchCancellationReason.CLIENT_STOPPED.value))
        other = sink.failure(RuntimeError("something else"))
    finally:
        sink.close(1)
    assert isinstance(prior, Retry) and prior.kind == PAUSED
    assert isinstance(stopped, Retry) and stopped.kind == "unavailable"
    assert isinstance(other, Retry) and other.kind == "RuntimeError"
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "pubsub://my-project/orders: unexpected RuntimeError: something else"
    ]
