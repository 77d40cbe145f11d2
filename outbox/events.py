"""Events: validation and encoding on the write side, decoding on the relay side.

Everything here is pure logic shared by the sync and async writer APIs and by
the relay. Validation happens before anything touches the database, so a bad
argument raises a ``TypeError``/``ValueError`` that names the field and leaves
the caller's transaction usable.
"""

from __future__ import annotations

import base64
import json
import json.scanner
import math
import re
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from operator import itemgetter
from typing import Any, NamedTuple

from outbox.errors import ConfigError, CorruptEvent, InvalidEvent, InvalidEventType

# Kafka's own limit for topic names; other sinks accept at least this much.
MAX_TOPIC_CHARS = 249
# Keys route events to partitions and order them; a key this large is a bug. The bound is what the
# key indexes take (a btree entry holds 2,704 bytes at most, the id beside the key included):
# a longer key was refused by PostgreSQL when the relay wrote it back (WAL capture), not at enqueue.
MAX_KEY_BYTES = 2048
MAX_HEADER_NAME_CHARS = 256
# CloudEvents type and subject travel as header values (ce_type, ce-subject): printable text.
MAX_TYPE_CHARS = 255
MAX_SUBJECT_CHARS = 1024

EVENT_ID_HEADER = "event-id"
"""The header that carries each event's id (a UUID, as text) on every sink: what a consumer keys
its duplicates on (:func:`outbox.inbox.first_delivery`)."""
KEY_HEADER = "event-key"  # the event's key, on sinks whose messages have no key of their own
# Set on an event `outbox verify --repair` sent again (its audit entry's id): the event keeps its
# event id, and a sink that drops a second message of an event id (JetStream's duplicate window)
# takes this one.
REPAIR_HEADER = "outbox-repair"
CLAIM_CHECK_HEADER = "outbox-claim-check"  # a big payload's reference (outbox.claim_check)
CORRUPT_TOPIC = "(corrupt)"  # the topic of what could not be decoded (results, WAL dead letters)
CONTENT_TYPE_HEADER = "content-type"
JSON_CONTENT_TYPE = "application/json"
# Header names the relay sets itself: a writer's copy would stand for the relay's (a forged
# event id, key or claim-check reference), so enqueue refuses them, and the relay dead-letters
# a stored row that holds one. Compared case-insensitively (HTTP's and NATS's names are).
RESERVED_HEADERS = frozenset({EVENT_ID_HEADER, KEY_HEADER, CLAIM_CHECK_HEADER})
# A header name is an RFC 9110 token: what HTTP, NATS and the other sinks' protocols can carry
# as a name without a space, a colon or a line break ending it early.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")

# The times an event may carry (its expiry; its creation time as stored), as seconds since the epoch:
# what Python's datetime, PostgreSQL's timestamptz and to_timestamp all hold (years 1 to 9999, UTC).
MIN_TIME = datetime(1, 1, 1, tzinfo=timezone.utc).timestamp()
MAX_TIME = datetime(9999, 12, 31, 23, 59, 59, tzinfo=timezone.utc).timestamp()

# Header values that are not UTF-8 text (or contain NUL, which jsonb cannot hold)
# are stored as {"b64": "..."}.
_B64 = "b64"


# Message headers as confluent-kafka takes them.
MessageHeaders = list[tuple[str, str | bytes | None]]


@dataclass(frozen=True, slots=True)
class EncodedEvent:
    """An event ready to be written: every field in its database form."""

    event_id: uuid.UUID
    topic: str
    key: bytes | None
    payload: bytes
    headers: dict[str, Any]
    delay: float
    type: str | None = None
    subject: str | None = None
    expires_at: float | None = None  # seconds since the epoch: not sent if claimed at or after it


class Unusable(NamedTuple):
    """Beside a WAL message's event (:data:`outbox.capture.wal_message.WalRow`), in place of its
    headers: the message is no deliverable event (unsigned, malformed), and the batch
    dead-letters it at once with this kind and reason."""

    kind: str
    reason: str


class ClaimedEvent(NamedTuple):
    """An event as the relay hands it to a sink.

    A NamedTuple, not a frozen dataclass: one is built per event on the relay's
    hot path, and a frozen dataclass pays ``object.__setattr__`` per field.
    """

    id: int
    event_id: str
    topic: str
    key: bytes | None
    payload: bytes
    headers: MessageHeaders
    created_at: float  # seconds since the epoch (the claim query sends it so: no datetime per event)
    attempts: int
    type: str | None = None  # enqueue(type=...): the CloudEvents type (the topic when None)
    subject: str | None = None  # enqueue(subject=...): the CloudEvents subject
    expires_at: float | None = None  # enqueue(expires_at=...), seconds since the epoch
    # When its transaction committed (epoch seconds), where PostgreSQL says: WAL capture always,
    # table capture with track_commit_timestamp on (a first attempt's). The latency's start.
    committed_at: float | None = None


# ClaimedEvent's fields as C-level getters, for map() over a batch on the relay's hot path.
TOPIC_OF, KEY_OF, PAYLOAD_OF, HEADERS_OF = (
    itemgetter(ClaimedEvent._fields.index(name)) for name in ("topic", "key", "payload", "headers")
)
EVENT_ID_OF, CREATED_OF, TYPE_OF, SUBJECT_OF, EXPIRES_OF, COMMITTED_OF = (
    itemgetter(ClaimedEvent._fields.index(name))
    for name in ("event_id", "created_at", "type", "subject", "expires_at", "committed_at")
)


def _text(value: str, field: str) -> bytes:
    try:
        return value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEvent(
            f"{field}: is not valid Unicode text (lone surrogate at index {exc.start})"
        ) from None


def encode_topic(topic: object) -> str:
    if not isinstance(topic, str):
        raise InvalidEventType(f"topic: expected str, got {type(topic).__name__}")
    if not topic:
        raise InvalidEvent("topic: must not be empty")
    if len(topic) > MAX_TOPIC_CHARS:
        raise InvalidEvent(f"topic: {len(topic)} characters long, at most {MAX_TOPIC_CHARS}")
    if "\x00" in topic:
        raise InvalidEvent("topic: must not contain NUL characters")
    _text(topic, "topic")
    return topic


def encode_attribute(value: object, field: str, limit: int) -> str | None:
    """``type`` / ``subject``: None, or printable text (it may travel as a header value)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidEventType(f"{field}: expected str or None, got {type(value).__name__}")
    if not value:
        raise InvalidEvent(f"{field}: must not be empty (leave it out instead)")
    if len(value) > limit:
        raise InvalidEvent(f"{field}: {len(value)} characters long, at most {limit}")
    if not value.isprintable():
        raise InvalidEvent(f"{field}: must be printable text (no control characters or line breaks)")
    _text(value, field)
    return value


def encode_key(key: object) -> bytes | None:
    if key is None:
        return None
    if isinstance(key, str):
        data = _text(key, "key")
    elif isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
    else:
        raise InvalidEventType(f"key: expected str, bytes or None, got {type(key).__name__}")
    if len(data) > MAX_KEY_BYTES:
        raise InvalidEvent(f"key: {len(data)} bytes long, at most {MAX_KEY_BYTES} allowed")
    return data


def encode_payload(payload: object) -> tuple[bytes, bool]:
    """The payload's bytes, and whether it was encoded as JSON."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload), False
    if isinstance(payload, str):
        return _text(payload, "payload"), False
    try:
        text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except TypeError as exc:
        raise InvalidEventType(f"payload: cannot be encoded as JSON: {exc}") from None
    except (ValueError, RecursionError) as exc:
        raise InvalidEvent(f"payload: cannot be encoded as JSON: {exc}") from None
    return _text(text, "payload"), True


def _header_value(name: str, value: object) -> str | dict[str, str]:
    field = f"headers[{name!r}]"
    if isinstance(value, str):
        raw = _text(value, field)
        return value if "\x00" not in value else {_B64: base64.b64encode(raw).decode()}
    if isinstance(value, (bytes, bytearray, memoryview)):
        data = bytes(value)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return {_B64: base64.b64encode(data).decode()}
        return text if "\x00" not in text else {_B64: base64.b64encode(data).decode()}
    raise InvalidEventType(f"{field}: expected str or bytes, got {type(value).__name__}")


def header_name_problem(name: str) -> str | None:
    """Why ``name`` cannot be an event's header name, or None: it must be an RFC 9110 token of
    at most MAX_HEADER_NAME_CHARS, and not one of the relay's own (:data:`RESERVED_HEADERS`)."""
    if not name or len(name) > MAX_HEADER_NAME_CHARS or not _TOKEN.fullmatch(name):
        return (
            f"header name {name!r} must be 1-{MAX_HEADER_NAME_CHARS} characters of an HTTP token "
            "(letters, digits and !#$%&'*+-.^_`|~; no spaces, colons or line breaks)"
        )
    if name.lower() in RESERVED_HEADERS:
        return f"{name!r} is set by outbox, not by the caller"
    return None


def encode_headers(headers: object) -> dict[str, Any]:
    if headers is None:
        return {}
    if not isinstance(headers, Mapping):
        raise InvalidEventType(
            f"headers: expected a mapping of str to str/bytes, got {type(headers).__name__}"
        )
    out: dict[str, Any] = {}
    for name, value in headers.items():
        if not isinstance(name, str):
            raise InvalidEventType(f"headers: header names must be str, got {type(name).__name__}")
        problem = header_name_problem(name)
        if problem is not None:
            raise InvalidEvent(f"headers: {problem}")
        out[name] = _header_value(name, value)
    return out


def encode_delay(delay: object) -> float:
    if delay is None:
        return 0.0
    if isinstance(delay, timedelta):
        seconds = delay.total_seconds()
    elif isinstance(delay, (int, float)) and not isinstance(delay, bool):
        try:
            seconds = float(delay)
        except OverflowError:  # an int of 400 digits
            raise InvalidEvent("delay: an integer too large for seconds") from None
    else:
        raise InvalidEventType(f"delay: expected seconds (float) or timedelta, got {type(delay).__name__}")
    if math.isnan(seconds) or math.isinf(seconds):
        raise InvalidEvent(f"delay: must be a finite number of seconds, got {seconds}")
    if seconds < 0:
        raise InvalidEvent(f"delay: must not be negative, got {seconds}")
    if seconds > MAX_TIME - time.time():  # PostgreSQL refused now() + delay: "timestamp out of range"
        raise InvalidEvent(f"delay: {seconds:g} seconds from now is past the year 9999")
    return seconds


def encode_expires_at(value: object) -> float | None:
    """``expires_at``: None, or a timezone-aware datetime (as seconds since the epoch)."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidEventType(f"expires_at: expected a timezone-aware datetime, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidEvent(
            "expires_at: must be timezone-aware (e.g. datetime.now(timezone.utc) + timedelta(minutes=5)); "
            "a naive datetime's zone would be a guess"
        )
    try:
        seconds = value.timestamp()
    except (OverflowError, ValueError):
        seconds = math.nan
    if not MIN_TIME <= seconds <= MAX_TIME:
        raise InvalidEvent(f"expires_at: {value!r} is out of range (years 1 to 9999, in UTC)")
    return seconds


def time_text(seconds: float) -> str:
    """A time (seconds since the epoch) for people: ISO 8601 when it is one datetime can hold, else
    as PostgreSQL says it (a stored ``-infinity``) or as the number it is (a year past 9999)."""
    if MIN_TIME <= seconds <= MAX_TIME:
        return datetime.fromtimestamp(seconds, timezone.utc).isoformat(timespec="milliseconds")
    if math.isinf(seconds):
        return "infinity" if seconds > 0 else "-infinity"
    return f"{seconds:.6g} s from the epoch (out of datetime's range)"


def encode_event(
    topic: object,
    payload: object,
    *,
    key: object = None,
    headers: object = None,
    delay: object = None,
    trace_headers: Mapping[str, str] | None = None,
    type: object = None,
    subject: object = None,
    expires_at: object = None,
) -> EncodedEvent:
    """Validate and encode one event; raises TypeError/ValueError naming the field."""
    t = encode_topic(topic)
    k = encode_key(key)
    body, is_json = encode_payload(payload)
    h = encode_headers(headers)
    d = encode_delay(delay)
    ty = encode_attribute(type, "type", MAX_TYPE_CHARS)
    su = encode_attribute(subject, "subject", MAX_SUBJECT_CHARS)
    ex = encode_expires_at(expires_at)
    if is_json and CONTENT_TYPE_HEADER not in h:
        h[CONTENT_TYPE_HEADER] = JSON_CONTENT_TYPE
    if trace_headers:
        for name, value in trace_headers.items():
            h.setdefault(name, value)  # an explicit header from the caller wins
    return EncodedEvent(uuid.uuid4(), t, k, body, h, d, ty, su, ex)


_ALLOWED_EVENT_FIELDS = frozenset(
    {"topic", "payload", "key", "headers", "delay", "type", "subject", "expires_at"}
)


def encode_event_mapping(
    index: int, event: object, trace_headers: Mapping[str, str] | None = None
) -> EncodedEvent:
    """Encode one element of ``enqueue_many``'s ``events``; errors name ``events[i].field``."""
    if not isinstance(event, Mapping):
        raise InvalidEventType(f"events[{index}]: expected a mapping, got {type(event).__name__}")
    unknown = set(event) - _ALLOWED_EVENT_FIELDS
    if unknown:
        raise InvalidEventType(f"events[{index}]: unknown field(s) {sorted(map(str, unknown))}")
    for required in ("topic", "payload"):
        if required not in event:
            raise InvalidEventType(f"events[{index}].{required}: missing")
    try:
        return encode_event(
            event["topic"],
            event["payload"],
            key=event.get("key"),
            headers=event.get("headers"),
            delay=event.get("delay"),
            trace_headers=trace_headers,
            type=event.get("type"),
            subject=event.get("subject"),
            expires_at=event.get("expires_at"),
        )
    except InvalidEventType as exc:
        raise InvalidEventType(f"events[{index}].{exc}") from None
    except InvalidEvent as exc:
        raise InvalidEvent(f"events[{index}].{exc}") from None


def decode_headers(raw: object) -> MessageHeaders:
    """Turn the stored jsonb headers (as JSON text, or already parsed) back into Kafka
    headers; CorruptEvent if malformed.

    ``None`` stands for no headers (the claim query turns ``{}`` into NULL). Runs once per
    claimed event: the JSON goes straight to the C scanner (``json.loads`` adds three
    Python calls around it), and plain string values take one list comprehension.
    """
    if raw is None:
        return []
    if isinstance(raw, str):  # the claim queries send jsonb as text: valid JSON, maybe not an object
        try:
            raw = parse_json(raw)
        except (ValueError, RecursionError) as exc:  # a WAL message's: written by no jsonb
            raise CorruptEvent(f"headers: not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CorruptEvent(f"headers: expected a JSON object, found {type(raw).__name__}")
    if not _CHECKED_NAMES.issuperset(raw):
        _check_names(raw)
    out: MessageHeaders
    try:
        out = [(name, value.encode()) for name, value in raw.items() if value.__class__ is str]
    except UnicodeEncodeError:  # a lone surrogate (\ud800): a WAL message's; jsonb has none
        raise CorruptEvent("headers: a value is not valid Unicode text") from None
    if len(out) == len(raw):
        return out
    out = []
    for name, value in raw.items():
        if isinstance(value, str):
            try:
                out.append((name, value.encode("utf-8")))
            except UnicodeEncodeError:
                raise CorruptEvent(f"headers[{name!r}]: not valid Unicode text") from None
        elif isinstance(value, dict) and set(value) == {_B64} and isinstance(value[_B64], str):
            try:
                out.append((name, base64.b64decode(value[_B64], validate=True)))
            except ValueError:
                raise CorruptEvent(f"headers[{name!r}]: invalid base64") from None
        else:
            raise CorruptEvent(f"headers[{name!r}]: expected a string, found {type(value).__name__}")
    return out


# Header names a stored row may hold, once checked: names repeat from event to event
# (content-type, traceparent), so the relay checks each once, not once per event.
_CHECKED_NAMES: set[str] = set()
_CHECKED_MAX = 10_000  # names remembered at most (then the set starts again)


def _check_names(headers: dict[str, Any]) -> None:
    """CorruptEvent for the first stored header name enqueue would have refused: rows written
    before the check, or by SQL of its own, may hold one, and no sink may send it."""
    for name in headers:
        if name not in _CHECKED_NAMES:
            problem = header_name_problem(name)
            if problem is not None:
                raise CorruptEvent(f"headers: {problem}")
            if len(_CHECKED_NAMES) >= _CHECKED_MAX:
                _CHECKED_NAMES.clear()
            _CHECKED_NAMES.add(name)


# The C scanner (typeshed declares make_scanner's argument as the scanner itself, not a decoder).
_scan_json: Callable[[str, int], tuple[Any, int]] = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def parse_json(text: str) -> object:
    """``json.loads(text)``, by the C scanner when the text is one JSON value and nothing else."""
    try:
        value, end = _scan_json(text, 0)
    except (StopIteration, ValueError):
        return json.loads(text)  # raises the decoder's own error, naming where
    if end != len(text):
        return json.loads(text)  # trailing text: the decoder's "Extra data" error
    return value


def decode_row(row: tuple[Any, ...]) -> ClaimedEvent:
    """A claimed row (``claim_batch``'s columns) as a ClaimedEvent.

    Raises CorruptEvent naming what is wrong. This runs once per event on the
    relay's hot path: keep it free of needless conversions.
    """
    id_, event_id, topic, key, payload, headers, created_at, attempts, type_, subject, expires, committed = (
        row
    )
    if not topic or not isinstance(topic, str):
        raise CorruptEvent("topic: empty or NULL")
    if payload is None:
        raise CorruptEvent("payload: NULL")
    if event_id is None:
        raise CorruptEvent("event_id: NULL")
    if len(topic) > MAX_TOPIC_CHARS:
        raise CorruptEvent(f"topic: {len(topic)} characters long, at most {MAX_TOPIC_CHARS}")
    if key is not None and len(key) > MAX_KEY_BYTES:  # a key that compresses fits the index
        raise CorruptEvent(f"key: {len(key)} bytes long, at most {MAX_KEY_BYTES}")
    if not MIN_TIME <= created_at <= MAX_TIME:  # a writer with the owner's grants may set it
        raise CorruptEvent(f"created_at: {time_text(created_at)} is out of range (years 1 to 9999)")
    if type_ is not None or subject is not None:
        check_attributes(type_, subject)
    kafka_headers = decode_headers(headers)
    kafka_headers.append((EVENT_ID_HEADER, event_id.encode()))
    # tuple.__new__ directly: a NamedTuple's own __new__ is one more Python call per event.
    fields = (
        id_,
        event_id,
        topic,
        key,
        payload,
        kafka_headers,
        created_at,
        attempts,
        type_,
        subject,
        expires,
        committed,
    )
    return new_claimed(ClaimedEvent, fields)


def check_attributes(type_: object, subject: object) -> None:
    """CorruptEvent when a stored ``type`` or ``subject`` (a row's, a WAL message's) is one enqueue
    refuses: they travel as header values (``ce_type``, ``ce-subject``), where a line break would
    start another header."""
    for value, field, limit in ((type_, "type", MAX_TYPE_CHARS), (subject, "subject", MAX_SUBJECT_CHARS)):
        if value is None:
            continue
        if value.__class__ is not str or not 0 < len(value) <= limit or not value.isprintable():
            raise CorruptEvent(
                f"{field}: must be 1 to {limit} characters of printable text (no control characters "
                "or line breaks)"
            )


new_claimed: Callable[[type[ClaimedEvent], tuple[Any, ...]], ClaimedEvent] = tuple.__new__


def key_bytes(text: str | None, field: str = "key") -> bytes | None:
    """A key as operators give it (``--key``, the console): UTF-8 text, or ``0x…`` for bytes;
    the inverse of :func:`key_text`."""
    if text is None:
        return None
    if text.startswith("0x"):
        try:
            return bytes.fromhex(text[2:])
        except ValueError:
            raise ConfigError(f"{field}: {text!r} is not valid hex after 0x") from None
    return text.encode("utf-8")


def key_text(key: bytes | None) -> str | None:
    """A key for people to read: its UTF-8 text, or ``0x…`` hex when it is not text."""
    if key is None:
        return None
    try:
        return bytes(key).decode("utf-8")
    except UnicodeDecodeError:
        return "0x" + bytes(key).hex()
