"""outbox.events: validation and encoding on the write side, decoding on the relay side (pure)."""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta, timezone

import pytest

from outbox.errors import CorruptEvent, InvalidEvent, InvalidEventType
from outbox.events import (
    MAX_KEY_BYTES,
    decode_row,
    encode_event,
    encode_event_mapping,
    encode_headers,
    key_text,
    time_text,
)


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
    row = (
        1,
        str(uuid.uuid4()),
        "t",
        None,
        b"p",
        encode_headers(raw),
        1_700_000_000.0,
        0,
        None,
        None,
        None,
        None,
    )
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
    row = (1, str(uuid.uuid4()), "t", None, b"p", headers, 1_700_000_000.0, 0, None, None, None, None)
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


@pytest.mark.parametrize(
    "when",
    [
        # Stored as 0001-12-31 BC: the relay then ended with "year 0 is out of range" (issue 70).
        datetime.min.replace(tzinfo=timezone(timedelta(hours=5))),
        datetime.max.replace(tzinfo=timezone(timedelta(hours=-5))),  # year 10000 in UTC
    ],
)
def test_an_expiry_out_of_the_range_every_reader_holds_is_refused_naming_it(when: datetime) -> None:
    with pytest.raises(InvalidEvent, match=r"^expires_at: .* out of range"):
        encode_event("t", b"", expires_at=when)
    assert encode_event("t", b"", expires_at=datetime(1, 1, 2, tzinfo=timezone.utc)).expires_at is not None


def test_a_key_is_refused_past_what_its_indexes_take() -> None:
    """A btree entry holds 2,704 bytes: a 3,000-byte key (the API allowed 4,096) was refused by
    PostgreSQL when the relay wrote a WAL event back, and the batch was read and sent again."""
    assert encode_event("t", b"", key=b"k" * MAX_KEY_BYTES).key == b"k" * MAX_KEY_BYTES
    with pytest.raises(InvalidEvent, match=r"^key: 2049 bytes long"):
        encode_event("t", b"", key=b"k" * (MAX_KEY_BYTES + 1))


@pytest.mark.parametrize(
    ("row_change", "field"),
    [
        ({4: "t" * 250}, "topic"),  # a writer's own SQL: the claim applies enqueue's limits
        ({3: b"k" * 2049}, "key"),
        ({6: float("-inf")}, "created_at"),  # a writer with the owner's grants may set it
        ({6: 1e300}, "created_at"),
        ({8: "a\r\nb"}, "type"),
        ({9: ""}, "subject"),
    ],
)
def test_a_claimed_row_is_held_to_the_limits_enqueue_applies(
    row_change: dict[int, object], field: str
) -> None:
    row: list[object] = [1, str(uuid.uuid4()), "t", None, b"p", None, 1.0, 0, None, None, None, None]
    if 4 in row_change:  # the topic is the third column
        row[2] = row_change.pop(4)
    for i, value in row_change.items():
        row[i] = value
    with pytest.raises(CorruptEvent, match=f"^{field}: "):
        decode_row(tuple(row))


def test_times_are_shown_whatever_their_range() -> None:
    assert time_text(0.0) == "1970-01-01T00:00:00.000+00:00"
    assert time_text(float("-inf")) == "-infinity" and time_text(float("inf")) == "infinity"
    assert "out of datetime's range" in time_text(9.2e12)


def test_a_delay_past_the_year_9999_is_refused_naming_it() -> None:
    """now() + 9.2e12 s: PostgreSQL refused the insert ("timestamp out of range"), an error that
    named no field; found by the input fuzzer (tests/fuzz)."""
    with pytest.raises(InvalidEvent, match=r"^delay: .* past the year 9999"):
        encode_event("t", b"", delay=9222521454154.0)
    with pytest.raises(InvalidEvent, match=r"^delay: an integer too large"):  # float() overflowed
        encode_event("t", b"", delay=10**400)
    assert encode_event("t", b"", delay=86400.0 * 365 * 100).delay > 0
