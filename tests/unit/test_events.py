"""outbox.events: validation and encoding on the write side, decoding on the relay side (pure)."""

from __future__ import annotations

import json
import uuid

import pytest

from outbox.errors import CorruptEvent, InvalidEvent, InvalidEventType
from outbox.events import decode_row, encode_event, encode_event_mapping, encode_headers, key_text


def test_json_payload_gets_content_type_unless_given() -> None:
    ev = encode_event("t", {"a": [1, 2]})
    assert ev.payload == b'{"a":[1,2]}'
    assert ev.headers["content-type"] == "application/json"
    ev = encode_event("t", {"a": 1}, headers={"content-type": "application/vnd.x+json"})
    assert ev.headers["content-type"] == "application/vnd.x+json"
    assert "content-type" not in encode_event("t", b"raw").headers


def test_explicit_traceparent_wins_over_the_active_context() -> None:
    ev = encode_event("t", b"x", headers={"traceparent": "mine"}, trace_headers={"traceparent": "ctx"})
    assert ev.headers["traceparent"] == "mine"


def test_headers_round_trip_byte_exact() -> None:
    raw = {"text": "caf\u00e9", "bin": b"\xff\x00", "utf8-bytes": "\u00e9".encode(), "nul": "a\x00"}
    row = (1, str(uuid.uuid4()), "t", None, b"p", encode_headers(raw), 1_700_000_000.0, 0, None, None, None)
    decoded = dict(decode_row(row).headers)
    assert decoded["text"] == "caf\u00e9".encode()
    assert decoded["bin"] == b"\xff\x00"
    assert decoded["utf8-bytes"] == "\u00e9".encode()
    assert decoded["nul"] == b"a\x00"
    assert decoded["event-id"] == row[1].encode()
    # As the claim queries send them: the jsonb as JSON text.
    as_text = (*row[:5], json.dumps(encode_headers(raw)), *row[6:])
    assert decode_row(as_text).headers == decode_row(row).headers


@pytest.mark.parametrize(
    "headers", [[1, 2], {"h": 1}, {"h": {"b64": "!!"}}, {"h": {"x": "y"}}, "[1, 2]", '{"h": 1}']
)
def test_corrupt_rows_are_named(headers: object) -> None:
    row = (1, str(uuid.uuid4()), "t", None, b"p", headers, 1_700_000_000.0, 0, None, None, None)
    with pytest.raises(CorruptEvent, match="headers"):
        decode_row(row)


def test_errors_are_typed_and_still_value_or_type_errors() -> None:
    with pytest.raises(InvalidEvent, match=r"^topic: ") as exc:
        encode_event("", b"x")
    assert isinstance(exc.value, ValueError)
    with pytest.raises(InvalidEventType, match=r"^key: ") as exc2:
        encode_event("t", b"x", key=42)
    assert isinstance(exc2.value, TypeError)
    with pytest.raises(InvalidEvent, match=r"^events\[3\]\.delay: "):
        encode_event_mapping(3, {"topic": "t", "payload": b"x", "delay": -1})
    with pytest.raises(InvalidEventType, match=r"^events\[0\]\.payload: "):
        encode_event_mapping(0, {"topic": "t", "payload": {1, 2}})


def test_keys_are_shown_as_text_or_hex() -> None:
    assert key_text(None) is None
    assert key_text(b"customer-7") == "customer-7"
    assert key_text(b"\xff\x00") == "0xff00"
