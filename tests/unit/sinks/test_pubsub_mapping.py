"""The Pub/Sub sink's mapping, pure logic: its URL, the ordering key and the attributes within
Pub/Sub's limits (which the emulator does not check)."""

from __future__ import annotations

import json

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
