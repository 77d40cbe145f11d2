"""WAL capture's pure parts: the message format, pgoutput's framing, names; and the bench's URLs."""

from __future__ import annotations

import struct

import pytest

from outbox import capture
from outbox.bench.writers import sqlalchemy_url
from outbox.events import decode_row, encode_event


def test_an_event_survives_its_wal_message_byte_exact() -> None:
    ev = encode_event(
        "orders", b"\x00\n\xffraw", key=b"k\n1", headers={"h": "v\nw", "b": b"\xff"}, type="t.é", subject=None
    )
    row = capture.decode(b"1732540000.25\n" + capture.encode(ev))
    claimed = decode_row(row)
    assert claimed.event_id == str(ev.event_id) and claimed.topic == "orders" and claimed.key == b"k\n1"
    assert claimed.payload == b"\x00\n\xffraw" and claimed.type == "t.é" and claimed.subject is None
    assert ("h", b"v\nw") in claimed.headers and ("b", b"\xff") in claimed.headers
    assert claimed.created_at == 1732540000.25
    bare = encode_event("t", b"", key=None, headers=None)
    assert capture.decode(b"1\n" + capture.encode(bare))[5] is None  # no headers: NULL, as a claim sends
    with pytest.raises(ValueError):
        capture.decode(b"not an event")


def _message(prefix: bytes, content: bytes) -> bytes:
    return b"M" + struct.pack(">BQ", 1, 42) + prefix + b"\0" + struct.pack(">I", len(content)) + content


def test_the_decoder_keeps_whole_committed_transactions_of_its_own_prefix_only() -> None:
    content = b"1\n" + capture.encode(encode_event("t", b"x", key=None, headers=None))
    decoder = capture.Decoder(b"outbox:a", skip_to=100)
    begin = b"B" + struct.pack(">QqI", 0, 0, 7)
    commit = lambda end: b"C" + struct.pack(">BQQq", 0, end - 1, end, 0)  # noqa: E731
    assert decoder.feed(begin) is None
    assert decoder.feed(_message(b"outbox:a", content)) is None
    assert decoder.feed(_message(b"outbox:ab", content)) is None  # another outbox's prefix
    assert decoder.feed(_message(b"outbox:a", b"garbage")) is None  # counted, skipped, said
    tx = decoder.feed(commit(200))
    assert tx is not None and len(tx.rows) == 1 and tx.end == 200 and tx.corrupt == 1
    decoder.feed(begin)
    decoder.feed(_message(b"outbox:a", content))
    assert decoder.feed(commit(90)) is None  # at or below what was handed on: skipped


def test_names_and_positions() -> None:
    assert capture.slot_name("Tenant-Ä") != capture.slot_name("tenant__")
    assert capture.slot_name("x" * 63).startswith("outbox_slot_") and len(capture.slot_name("x" * 63)) <= 63
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
