"""WAL capture (issue 30): events emitted to the WAL, read from the outbox's slot, delivered.

Against a PostgreSQL with wal_level=logical (the ``wal_dsn`` fixture: the matrix's servers, or
one of this worker's own) and the real Kafka-protocol broker."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

import outbox
from outbox import capture
from outbox.errors import ConfigError
from outbox.relay import RelayConfig
from tests.helpers import assert_per_key_order, count, read_topic, running_relay, wait_for


def test_enqueue_in_wal_mode_writes_no_row_and_the_relay_delivers_it_byte_exact(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    payloads = [b"\x00\xffraw bytes\n", {"order": 7, "lines": ["a", "b"]}, "text \u00e9"]
    with psycopg.connect(wal_dsn) as conn:
        ids = [
            outbox.enqueue(conn, topic, p, key=f"k{i % 2}", headers={"h": "v"}, schema=wal_schema, type="order.placed")
            for i, p in enumerate(payloads)
        ]
        with conn.transaction(force_rollback=True):  # a savepoint rolled back: never delivered
            outbox.enqueue(conn, topic, b"rolled back", schema=wal_schema)
    with psycopg.connect(wal_dsn) as conn:
        outbox.enqueue(conn, topic, b"whole transaction rolled back", schema=wal_schema)
        conn.rollback()
    assert count(wal_dsn, wal_schema, "events") == 0  # nothing went into the table
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema), bootstrap=kafka):
        messages = read_topic(kafka, topic, 3)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 3, timeout=30, what="archive")
    assert len(messages) == 3  # the rolled-back ones never
    by_id = {m.event_id: m for m in messages}
    first, second, third = (by_id[str(i)] for i in ids)
    assert first.value == b"\x00\xffraw bytes\n"
    assert json.loads(second.value) == {"order": 7, "lines": ["a", "b"]}
    assert third.value == "text \u00e9".encode()
    assert all(m.headers["h"] == b"v" for m in messages)
    assert [first.key, second.key, third.key] == [b"k0", b"k1", b"k0"]
    assert first.offset < third.offset  # one key: commit order
    with psycopg.connect(wal_dsn) as conn:
        archived = conn.execute(
            f'SELECT event_id::text, type, sink_partition IS NOT NULL FROM "{wal_schema}".delivered ORDER BY id'
        ).fetchall()
        slot = conn.execute(
            "SELECT confirmed_flush_lsn >= (SELECT lsn FROM \"%s\".capture) FROM pg_replication_slots WHERE slot_name = %%s"
            % wal_schema,
            (capture.slot_name(wal_schema),),
        ).fetchone()
    assert archived == [(str(i), "order.placed", True) for i in ids]
    assert slot == (True,)
