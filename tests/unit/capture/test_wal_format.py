"""WAL capture's pure parts: the message format, pgoutput's framing, names; and the bench's URLs."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from outbox_bench.writers import sqlalchemy_url

from outbox import capture
from outbox.capture import pgoutput, wal_message
from outbox.events import Unusable, encode_event


def test_an_event_survives_its_wal_message_byte_exact() -> None:
    ev = encode_event(
        "orders", b"\x00\n\xffraw", key=b"k\n1", headers={"h": "v\nw", "b": b"\xff"}, type="t.é", subject=None
    )
    claimed, text = wal_message.decode(b"1732540000.25\n" + wal_message.encode(ev))
    assert isinstance(text, str) and json.loads(text) == ev.headers  # stored as the message held them
    assert claimed.event_id == str(ev.event_id) and claimed.topic == "orders" and claimed.key == b"k\n1"
    assert claimed.payload == b"\x00\n\xffraw" and claimed.type == "t.é" and claimed.subject is None
    assert ("h", b"v\nw") in claimed.headers and ("b", b"\xff") in claimed.headers
    assert ("event-id", str(ev.event_id).encode()) in claimed.headers
    assert claimed.created_at == 1732540000.25 and claimed.attempts == 0
    bare = encode_event("t", b"", key=None, headers=None)
    assert wal_message.decode(b"1\n" + wal_message.encode(bare))[1] is None  # no headers: NULL
    with pytest.raises(ValueError):
        wal_message.decode(b"not an event")


@pytest.mark.parametrize(
    ("head", "headers", "why"),
    [
        (b'["not-a-uuid","t",null,null,null]', b"", "id: not a UUID"),
        (b'["00000000-0000-4000-8000-000000000000","",null,null,null]', b"", "topic"),
        (b'["00000000-0000-4000-8000-000000000000","a\\u0000b",null,null,null]', b"", "topic"),
        (b'["00000000-0000-4000-8000-000000000000","\\ud800",null,null,null]', b"", "topic"),
        (b'["00000000-0000-4000-8000-000000000000",7,null,null,null]', b"", "topic"),
        (b'["00000000-0000-4000-8000-000000000000","t","zz",null,null]', b"", "key: not hex"),
        (b'["00000000-0000-4000-8000-000000000000","t",null,5,null]', b"", "type"),
        (b'["00000000-0000-4000-8000-000000000000","t",null,null,null]', b'{"a":"\\u0000"}', "NUL"),
        (b'{"a":1}', b"", "head: not a JSON array"),
        (b"not json", b"", "head: not an event's encoding"),
        # Issue 70: what PostgreSQL, to_timestamp or datetime cannot hold, named (an integer of 400
        # digits raised OverflowError, which the decoder did not catch: the reader crashed in a loop).
        (b'["00000000-0000-4000-8000-000000000000","t",null,null,null,1e300]', b"", "expires_at"),
        (b'["00000000-0000-4000-8000-000000000000","t",null,null,null,-1e300]', b"", "expires_at"),
        (
            b'["00000000-0000-4000-8000-000000000000","t",null,null,null,1' + b"0" * 400 + b"]",
            b"",
            "expires_at",
        ),
        (b'["00000000-0000-4000-8000-000000000000","t",null,null,null,"soon"]', b"", "expires_at"),
        (b'["00000000-0000-4000-8000-000000000000","t",null,null,null,true]', b"", "expires_at"),
        (b'["00000000-0000-4000-8000-000000000000","t","' + b"ab" * 2049 + b'",null,null]', b"", "key: 2049"),
        (b'["00000000-0000-4000-8000-000000000000","t",null,"a\\r\\nb",null]', b"", "type"),
        (b'["00000000-0000-4000-8000-000000000000","t",null,null,"' + b"s" * 1025 + b'"]', b"", "subject"),
    ],
)
def test_a_signed_message_whose_fields_do_not_parse_is_refused_naming_the_field(
    head: bytes, headers: bytes, why: str
) -> None:
    """What PostgreSQL could not store (no UUID, NUL, a lone surrogate) or a sink not send: a
    ValueError, which the decoder turns into a row dead-lettered at once."""
    with pytest.raises((ValueError, TypeError), match=why):
        wal_message.decode(b"1\n" + head + b"\n" + headers + b"\npayload")


KEY = b"k" * 32  # the outbox's signing key in these tests
KEYS = wal_message.Keys([(KEY, None)])


def _message(prefix: bytes, content: bytes, key: bytes | None = KEY) -> bytes:
    """A pgoutput message record; its content signed with ``key`` (None: as given)."""
    signed = content if key is None else wal_message.sign(key, content)
    return b"M" + struct.pack(">BQ", 1, 42) + prefix + b"\0" + struct.pack(">I", len(signed)) + signed


def _begin(commit: int, at: float = 0.0) -> bytes:
    """A transaction's begin record; ``at``: its commit time (epoch seconds; 0: 2000-01-01)."""
    micros = 0 if not at else int((at - pgoutput.PG_EPOCH) * 1e6)
    return b"B" + struct.pack(">QqI", commit, micros, 7)


def _commit(commit: int, end: int) -> bytes:
    return b"C" + struct.pack(">BQQq", 0, commit, end, 0)


def _event(seq: int) -> bytes:
    return _message(
        b"outbox:a", b"1\n" + wal_message.encode(encode_event("t", str(seq).encode(), key=None, headers=None))
    )


def test_the_decoder_keeps_committed_transactions_of_its_own_prefix_only() -> None:
    content = b"1\n" + wal_message.encode(encode_event("t", b"x", key=None, headers=None))
    decoder = capture.Decoder(b"outbox:a", skip=capture.Position(100), keys=KEYS)
    assert decoder.feed(_begin(150)) is None
    assert decoder.feed(_message(b"outbox:a", content)) is None
    assert decoder.feed(_message(b"outbox:ab", content)) is None  # another outbox's prefix
    assert decoder.feed(_message(b"outbox:a", b"garbage")) is None  # signed, but no event
    assert decoder.feed(_message(b"outbox:a", content, key=b"another key")) is None  # not ours
    assert decoder.feed(_message(b"outbox:a", content, key=None)) is None  # not signed at all
    piece = decoder.feed(_commit(150, 200))
    assert piece is not None and len(piece.rows) == 4 and piece.whole
    assert piece.after == capture.Position(200)
    (event, text), (garbage, why), *unsigned = piece.rows
    assert event.topic == "t" and event.payload == b"x" and text is None
    # The others are rows the batch dead-letters at once: a new id, no key, the content kept.
    assert garbage.topic == "(corrupt)" and garbage.payload == b"garbage" and garbage.key is None
    assert [row.topic for row, _ in unsigned] == ["(unsigned)", "(unsigned)"]
    assert unsigned[1][0].payload == content and unsigned[1][0].event_id != event.event_id
    assert isinstance(why, Unusable) and why.kind == "corrupt_event"
    assert why.reason.startswith("corrupt event row: a signed WAL message that is no outbox event")
    assert [u.kind for _, u in unsigned] == ["unsigned_event", "unsigned_event"]  # type: ignore[union-attr]
    decoder = capture.Decoder(b"outbox:a", skip=capture.Position(100), keys=KEYS)
    decoder.feed(_begin(80))
    decoder.feed(_message(b"outbox:a", content))
    assert decoder.feed(_commit(80, 90)) is None  # ended before what was handed on: skipped
    decoder.feed(_begin(300))
    empty = decoder.feed(_commit(300, 310))  # nothing of ours: the slot may move past it
    assert empty is not None and empty.whole and not empty.rows and empty.after == capture.Position(310)


def _payloads(piece: capture.Piece) -> list[int]:
    return [int(event.payload) for event, _ in piece.rows]


def test_a_large_transaction_goes_in_pieces_each_with_its_position() -> None:
    """Issue 30: a transaction is never held whole; each piece says how far it reaches inside its
    transaction (the commit record's LSN and the events so far), and only its last piece carries
    the transaction's end, the one position the slot may be confirmed to."""
    decoder = capture.Decoder(b"outbox:a", skip=capture.Position(100), piece=1000, keys=KEYS)
    decoder.feed(_begin(500))
    pieces = [p for seq in range(2500) if (p := decoder.feed(_event(seq))) is not None]
    pieces.append(decoder.feed(_commit(500, 600)))  # type: ignore[arg-type]
    assert [len(p.rows) for p in pieces] == [1000, 1000, 500]
    assert [p.after for p in pieces] == [
        capture.Position(100, 500, 1000),
        capture.Position(100, 500, 2000),
        capture.Position(600),
    ]
    assert [p.whole for p in pieces] == [False, False, False]
    assert _payloads(pieces[0])[0] == 0 and _payloads(pieces[2])[-1] == 2499
    assert pieces[0].after < pieces[1].after < pieces[2].after  # a transaction's end after its pieces
    assert capture.Position(600) < capture.Position(100, 600, 1)  # the next transaction after it
    # A piece that is the transaction's last full one: an empty last piece still carries the end.
    decoder.feed(_begin(700))
    full = [p for seq in range(1000) if (p := decoder.feed(_event(seq))) is not None]
    last = decoder.feed(_commit(700, 800))
    assert len(full) == 1 and last is not None and not last.rows and not last.whole
    assert last.after == capture.Position(800)


def test_reading_again_resumes_inside_a_transaction_handed_on_in_part() -> None:
    """The slot sends again from its confirmed position (whole transactions only): what was handed
    on, down to the event inside a transaction, is skipped; nothing after it is."""
    decoder = capture.Decoder(b"outbox:a", skip=capture.Position(100, 500, 1000), piece=1000, keys=KEYS)
    decoder.feed(_begin(50))  # ended before 100: handed on whole
    assert decoder.feed(_event(0)) is None
    assert decoder.feed(_commit(50, 60)) is None
    decoder.feed(_begin(500))
    pieces = [p for seq in range(2500) if (p := decoder.feed(_event(seq))) is not None]
    pieces.append(decoder.feed(_commit(500, 600)))  # type: ignore[arg-type]
    assert [_payloads(p)[0] for p in pieces] == [1000, 2000]  # the first 1,000 were handed on
    assert sum(len(p.rows) for p in pieces) == 1500
    assert pieces[0].after == capture.Position(100, 500, 2000) and pieces[-1].after == capture.Position(600)


def test_names_and_positions() -> None:
    assert capture.slot_name("Tenant-Ä", "db") != capture.slot_name("tenant__", "db")
    assert capture.slot_name("outbox", "orders") != capture.slot_name(
        "outbox", "billing"
    )  # slots are the server's
    assert (
        capture.slot_name("x" * 63, "db").startswith("outbox_slot_")
        and len(capture.slot_name("x" * 63, "d")) <= 63
    )
    assert (
        capture.slot_names("outbox", "db")[1]
        == "outbox_slot_outbox_" + hashlib.sha256(b"outbox").hexdigest()[:8]
    )
    assert capture.lsn_int(capture.lsn_text(0x1_0000_00AB)) == 0x1_0000_00AB
    assert capture.lsn_text(0x16_B374_D848) == "16/B374D848"
    assert capture.prefix_of("orders") == "outbox:orders"


def test_bench_urls_reach_a_socket_directory_too() -> None:
    assert sqlalchemy_url("host=127.0.0.1 port=5433 dbname=d user=u password=p", "asyncpg") == (
        "postgresql+asyncpg://u:p@127.0.0.1:5433/d"
    )
    # The embedded PostgreSQL listens on a socket directory: asyncpg took "/tmp/…:5432" for a
    # database name, and every peer of the drain bench failed on the embedded defaults.
    assert sqlalchemy_url("postgresql://root@/postgres?host=/tmp/pg/data", "") == (
        "postgresql://root@/postgres?host=%2Ftmp%2Fpg%2Fdata&port=5432"
    )


def test_the_readers_signer_is_hmac_sha256() -> None:
    """The pads hashed once give what hmac gives (what emit_events computes in SQL)."""
    import hashlib
    import hmac

    for key in (KEY, b"", b"k" * 64, b"k" * 65):
        signer = wal_message.Signer(key)
        for content in (b"", b"x", b"y" * 1000):
            assert signer.signature(content) == hmac.new(key, content, hashlib.sha256).digest()


def test_a_message_outside_any_transaction_is_no_event_and_holds_nothing_back() -> None:
    """pg_logical_emit_message(false, ...) is open to every role, and its message comes between
    transactions, committed by nobody. It is passed over: not kept for the next transaction's
    piece (where it sat, and the reader's idle feedback waited for ``rows`` to empty)."""
    content = b"1\n" + wal_message.encode(encode_event("t", b"x", key=None, headers=None))
    stray = b"M" + struct.pack(">BQ", 0, 42) + b"outbox:a\0" + struct.pack(">I", 40) + b"s" * 40
    decoder = capture.Decoder(b"outbox:a", skip=capture.Position(100), keys=KEYS)
    assert decoder.feed(stray) is None
    assert decoder.rows == [] and decoder.ignored == 1
    decoder.feed(_begin(150))
    decoder.feed(_message(b"outbox:a", content))
    piece = decoder.feed(_commit(150, 200))
    assert piece is not None and len(piece.rows) == 1 and piece.rows[0][0].payload == b"x"


def test_after_a_rotation_the_old_key_verifies_what_committed_within_the_window_only() -> None:
    """``outbox capture rotate-key``: the rotation's message, signed with the key it retires,
    tells the reader to read the keys again. Then the new key verifies, and the old one only what
    committed before its window ended: a leaked old key signs nothing that is delivered later."""
    old, new = b"o" * 32, b"n" * 32
    content = b"1\n" + wal_message.encode(encode_event("t", b"x", key=None, headers=None))
    decoder = capture.Decoder(b"outbox:a", skip=capture.Position(100), keys=wal_message.Keys([(old, None)]))
    decoder.feed(_begin(150, at=1_000.0))
    assert decoder.feed(_message(b"outbox:a", wal_message.ROTATED + b"2", key=old)) is None
    assert decoder.rotated and decoder.rows == []  # no row: the reader reads the keys now
    decoder.keys = wal_message.Keys([(new, None), (old, 2_000.0)])
    decoder.rotated = False
    decoder.feed(_message(b"outbox:a", content, key=new))
    decoder.feed(_message(b"outbox:a", content, key=old))  # committed within the window
    piece = decoder.feed(_commit(150, 200))
    assert piece is not None and [event.payload for event, _ in piece.rows] == [b"x", b"x"]
    decoder.feed(_begin(300, at=2_500.0))  # after the window
    decoder.feed(_message(b"outbox:a", content, key=old))
    decoder.feed(_message(b"outbox:a", content, key=new))
    late, fresh = decoder.feed(_commit(300, 310)).rows  # type: ignore[union-attr]
    assert late[0].topic == "(unsigned)" and fresh[0].payload == b"x" and fresh[1] is None
    unsigned_rotation = capture.Decoder(b"outbox:a", keys=wal_message.Keys([(old, None)]))
    unsigned_rotation.feed(_begin(400))
    unsigned_rotation.feed(_message(b"outbox:a", wal_message.ROTATED + b"9", key=b"x" * 32))
    assert (
        not unsigned_rotation.rotated and unsigned_rotation.rows[0][0].topic == "(unsigned)"
    )  # a stranger's


def test_headers_no_sink_may_send_keep_the_events_fields_and_say_why() -> None:
    """A signed message whose headers are not an object of strings (a writer's own SQL): the
    event keeps its id, key and payload (dead-lettered as it is, its key parked with --on-dead
    park), and the reason names the headers; its headers are not stored."""
    head = b'["00000000-0000-4000-8000-000000000000","t","6b",null,null]'
    for headers, why in ((b'{"n":5}', "headers['n']: expected a string"), (b"[1]", "expected a JSON object")):
        event, unusable = wal_message.decode(b"1\n" + head + b"\n" + headers + b"\npayload")
        assert event.event_id == "00000000-0000-4000-8000-000000000000" and event.key == b"k"
        assert event.payload == b"payload" and event.headers == []
        assert isinstance(unusable, Unusable) and unusable.kind == "corrupt_event"
        assert unusable.reason.startswith("corrupt event row: ") and why in unusable.reason


def test_any_error_of_the_decoder_is_that_messages_dead_letter_kept_as_a_bounded_prefix() -> None:
    """Whatever a writer's signed bytes make the decoder raise (not only the errors it expects),
    and whatever a stranger's unsigned message holds, is a row dead-lettered at once: never an
    exception out of row_of (the reader's thread would read the same message again, for ever).
    What it keeps is the first KEPT_BYTES, and its reason the whole's length and digest."""
    huge = b"1\n" + b'["00000000-0000-4000-8000-000000000000","t",null,null,null,1' + b"0" * 400 + b"]\n\n"
    row = wal_message.row_of(wal_message.sign(KEY, huge), KEYS, b"outbox:a", 0.0)
    assert row is not None and isinstance(row[1], Unusable)
    assert row[1].kind == "corrupt_event" and "expires_at" in row[1].reason
    stranger = b"x" * (wal_message.KEPT_BYTES * 3)
    row = wal_message.row_of(stranger, KEYS, b"outbox:a", 0.0)
    assert row is not None and isinstance(row[1], Unusable) and row[1].kind == "unsigned_event"
    assert row[0].payload == stranger[: wal_message.KEPT_BYTES] and row[0].key is None
    assert f"{len(stranger)} bytes, sha256 {hashlib.sha256(stranger).hexdigest()}" in row[1].reason
