"""One WAL capture message: its format, its signature, and what the reader makes of it.

Each message's content: its signature (32 bytes), the creation time (epoch seconds, text,
from the server's clock), a line break, one line of JSON (id, topic, key as hex, type,
subject, and the expiry in epoch seconds if the event has one), a line break, the headers as
one line of JSON, a line break, and the payload's bytes as they are.

Writers emit through the outbox's ``emit_events`` function (migration 0015), which signs each
message with HMAC-SHA256 under the outbox's key (``capture_key``, readable by the function's
owner and the relay alone). ``pg_logical_emit_message`` is open to every role: a message under
the prefix that is not signed is no writer's, and the reader (:class:`outbox.capture.Decoder`)
turns it into a row that is dead-lettered at once (``unsigned_event``), under a new event id
and without its key, so it can neither be delivered nor park a key. A signed message whose
fields do not parse (a writer's own SQL) is dead-lettered too (``corrupt_event``). Neither
stops the reader.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

from outbox.errors import CorruptEvent
from outbox.events import (
    CORRUPT_TOPIC,
    EVENT_ID_HEADER,
    MAX_KEY_BYTES,
    MAX_TIME,
    MAX_TOPIC_CHARS,
    MIN_TIME,
    ClaimedEvent,
    EncodedEvent,
    Unusable,
    check_attributes,
    decode_headers,
    new_claimed,
    parse_json,
)

SIGNATURE_BYTES = 32  # HMAC-SHA256, before each message's content
KEPT_BYTES = 64 * 1024  # bytes a dead letter keeps of a message that is no deliverable event
UNSIGNED_EVENT = "unsigned_event"  # the dead letter's kind of a message that is not signed
CORRUPT_EVENT = "corrupt_event"  # ... of a signed one that is no event's encoding
UNSIGNED_TOPIC = "(unsigned)"  # the topic such dead letters are kept under
# A key rotation's message (capture_key_rotated): its content, after the signature, starts so.
# An event's starts with its creation time (digits), which emit_events puts there itself.
ROTATED = b"rotate\n"
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")  # \u0000 not itself escaped
_is_uuid_text = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}").fullmatch


def encode(ev: EncodedEvent) -> bytes:
    """An event as its WAL message's content, after the creation time the statement adds: a JSON
    array (id, topic, key as hex, type, subject), a line break, the headers as JSON (empty when
    none: JSON escapes line breaks, so neither line holds one), a line break, the payload."""
    head: list[Any] = [
        str(ev.event_id),
        ev.topic,
        None if ev.key is None else ev.key.hex(),
        ev.type,
        ev.subject,
    ]
    if ev.expires_at is not None:  # a sixth field only then: relays before 0.3 read five
        head.append(ev.expires_at)
    headers = json.dumps(ev.headers, separators=(",", ":")).encode() if ev.headers else b""
    return json.dumps(head, separators=(",", ":")).encode() + b"\n" + headers + b"\n" + ev.payload


# An event read from the WAL: the event as the sinks take it, and its headers as the JSON text
# the message held (stored as they are when it goes to the archive or the table; None: none);
# or, in their place, why the message is no deliverable event (dead-lettered at once, the event
# standing for what is kept).
WalRow = tuple[ClaimedEvent, "str | Unusable | None"]


def decode(content: bytes, committed: float | None = None) -> WalRow:
    """A message's content (after its signature) as the event it carries, decoded once (the
    relay's loop takes it as it is); ``committed``: when its transaction committed (epoch).
    Raises ValueError (or TypeError) if it is not an outbox event's encoding: an id that is not a
    UUID, a topic that is not text a topic may be, and so on. Headers no sink may send (not a
    JSON object of strings, a name enqueue refuses) make it a corrupt event that keeps its
    fields, dead-lettered at once."""
    try:
        created, head, headers, payload = content.split(b"\n", 3)
        # Parsed as text by the C scanner: json.loads on bytes first guesses the encoding and
        # decodes with surrogatepass, at five times the cost (decision 0013).
        parsed: Any = parse_json(head.decode())
    except ValueError as exc:  # its reason names what it is not (a writer's own bytes)
        raise ValueError(f"head: not an event's encoding (a line of JSON after its time): {exc}") from None
    if parsed.__class__ is not list or not 5 <= len(parsed) <= 6:
        raise ValueError("head: not a JSON array of 5 or 6 fields (id, topic, key, type, subject, expiry)")
    event_id, topic, key, type_, subject, *rest = parsed
    expires = None
    if rest:
        (expires,) = rest
        expires = _time(expires, "expires_at")
    if event_id.__class__ is not str or not _is_uuid_text(event_id):
        raise ValueError("id: not a UUID")
    if topic.__class__ is not str or not 0 < len(topic) <= MAX_TOPIC_CHARS or not _storable(topic):
        raise ValueError("topic: not a topic's text")
    if type_ is not None and (type_.__class__ is not str or not _storable(type_)):
        raise ValueError("type: not text")
    if subject is not None and (subject.__class__ is not str or not _storable(subject)):
        raise ValueError("subject: not text")
    if b"u0000" in headers and _NUL_ESCAPE.search(headers):  # jsonb refuses; enqueue never writes it
        raise ValueError("headers: a NUL character")
    if type_ is not None or subject is not None:
        check_attributes(type_, subject)
    try:
        text = headers.decode() if headers else None
    except UnicodeDecodeError:
        raise ValueError("headers: not UTF-8") from None
    try:
        raw_key = None if key is None else bytes.fromhex(key)
    except (TypeError, ValueError):
        raise ValueError("key: not hex text") from None
    if raw_key is not None and len(raw_key) > MAX_KEY_BYTES:
        raise ValueError(f"key: {len(raw_key)} bytes long, at most {MAX_KEY_BYTES}")
    at = _time(float(created), "created_at")
    try:
        sent = decode_headers(text)
    except CorruptEvent as exc:  # a signed message's own SQL: kept, never sent
        kept, about = bounded(payload)
        unsent: tuple[Any, ...] = (
            0,
            event_id,
            topic,
            raw_key,
            kept,
            [],
            at,
            0,
            type_,
            subject,
            expires,
            committed,
        )
        return new_claimed(ClaimedEvent, unsent), Unusable(exc.kind, f"corrupt event row: {exc}{about}")
    sent.append((EVENT_ID_HEADER, event_id.encode()))
    # tuple.__new__ directly: a NamedTuple's own __new__ is one more Python call per event.
    fields: tuple[Any, ...] = (
        0,
        event_id,
        topic,
        raw_key,
        payload,
        sent,
        at,
        0,
        type_,
        subject,
        expires,
        committed,
    )
    return new_claimed(ClaimedEvent, fields), text


def _time(value: Any, field: str) -> float:
    """A time in a message (epoch seconds) as a float; ValueError naming ``field`` unless it is
    a number in the range every reader and PostgreSQL hold (years 1 to 9999)."""
    if value.__class__ not in (float, int):
        raise ValueError(f"{field}: not a time (seconds since the epoch)")
    try:
        seconds = float(value)
    except OverflowError:  # an integer of 400 digits
        raise ValueError(f"{field}: an integer of {len(str(value))} digits is out of range") from None
    if not MIN_TIME <= seconds <= MAX_TIME:
        raise ValueError(f"{field}: {seconds:.6g} is out of range (seconds since the epoch, years 1 to 9999)")
    return seconds


def bounded(content: bytes) -> tuple[bytes, str]:
    """What a dead letter keeps of a message that is no deliverable event: at most
    :data:`KEPT_BYTES` of it, and (when that is not all) a note of its length and digest for the
    reason. A stranger's message may be a gigabyte; kept whole, three of them in one transaction
    were more than PostgreSQL takes in one statement."""
    if len(content) <= KEPT_BYTES:
        return content, ""
    digest = hashlib.sha256(content).hexdigest()
    return content[:KEPT_BYTES], f" ({len(content)} bytes, sha256 {digest}; the first {KEPT_BYTES} kept)"


def _storable(text: str) -> bool:
    """Can PostgreSQL store ``text`` (no NUL, no lone surrogate from a JSON escape)?"""
    if text.isascii():
        return "\0" not in text
    if "\0" in text:
        return False
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class Keys:
    """The outbox's signing keys (migration 0021), newest first, each with the time (epoch) from
    which what commits no longer verifies with it (None: the current key). A message verifies
    with a key its transaction committed before retiring: after a rotation, the old key verifies
    for the rotation's window, and what a leaked old key signs later does not."""

    def __init__(self, keys: Sequence[tuple[bytes, float | None]]) -> None:
        if not keys:
            raise ValueError("keys: the outbox has no signing key (run `outbox migrate`)")
        self._keys = [(Signer(key), retire) for key, retire in keys]
        self._newest = self._keys[0][0]

    def verify(self, body: bytes, signature: bytes, committed: float) -> bool:
        """Is ``signature`` ``body``'s, under a key not retired when its transaction committed?"""
        if hmac.compare_digest(self._newest.signature(body), signature) and (
            self._keys[0][1] is None or committed < self._keys[0][1]
        ):
            return True
        return any(
            (retire is None or committed < retire) and hmac.compare_digest(signer.signature(body), signature)
            for signer, retire in self._keys[1:]
        )


class Signer:
    """HMAC-SHA256 under one key, its two pads hashed once (as ``capture_key`` keeps them for
    emit_events): a message then costs two hash copies, where ``hmac.digest`` sets the key up
    again each time, and the reader checks every message (decision 0013)."""

    def __init__(self, key: bytes) -> None:
        block = (hashlib.sha256(key).digest() if len(key) > 64 else key).ljust(64, b"\0")
        self._inner = hashlib.sha256(bytes(b ^ 0x36 for b in block))
        self._outer = hashlib.sha256(bytes(b ^ 0x5C for b in block))

    def signature(self, content: bytes) -> bytes:
        inner = self._inner.copy()
        inner.update(content)
        outer = self._outer.copy()
        outer.update(inner.digest())
        return outer.digest()


def sign(key: bytes, content: bytes) -> bytes:
    """``content`` as emit_events emits it: its HMAC-SHA256 under ``key``, then itself."""
    return hmac.digest(key, content, "sha256") + content


def unusable_row(kind: str, reason: str, content: bytes) -> WalRow:
    """A message that is no deliverable event, as a row the batch dead-letters at once: under a
    new event id (its own may be forged, or no id), without a key (it must not park one), with
    its whole content as the payload (nothing is lost), and why (:class:`Unusable`)."""
    topic = UNSIGNED_TOPIC if kind == UNSIGNED_EVENT else CORRUPT_TOPIC
    kept, about = bounded(content)
    why = (f"corrupt event row: {reason}" if kind == CORRUPT_EVENT else reason) + about
    fields: tuple[Any, ...] = (
        0,
        str(uuid.uuid4()),
        topic,
        None,
        kept,
        [],
        time.time(),
        0,
        None,
        None,
        None,
        None,
    )
    return new_claimed(ClaimedEvent, fields), Unusable(kind, why)


def row_of(content: bytes, keys: Keys, prefix: bytes, committed: float) -> WalRow | None:
    """A message's row: its event if it is signed and parses, else one dead-lettered at once.
    None for a key rotation's message (``outbox capture rotate-key``): read the keys again.
    ``committed``: when its transaction committed (epoch), which keys may have signed it."""
    body = content[SIGNATURE_BYTES:]
    if len(content) < SIGNATURE_BYTES or not keys.verify(body, content[:SIGNATURE_BYTES], committed):
        return unusable_row(
            UNSIGNED_EVENT,
            f"a WAL message under {prefix.decode(errors='replace')} whose signature does not "
            "verify: not emitted by the outbox's emit_events (another role's "
            "pg_logical_emit_message?); kept as the payload, never delivered",
            content,
        )
    if body.startswith(ROTATED):
        return None
    try:
        return decode(body, committed)
    except Exception as exc:  # whatever a writer's own bytes make it raise: that message's dead letter
        why = f"a signed WAL message that is no outbox event: {_said(exc)}"
        return unusable_row(CORRUPT_EVENT, why, body)


def _said(exc: Exception) -> str:
    """An error of the decoder in a few words (a ValueError names its field; others their type)."""
    text = str(exc)[:300]
    return text if isinstance(exc, ValueError) and text else f"{type(exc).__name__}: {text}"
