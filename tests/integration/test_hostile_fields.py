"""One event's fields never end, stall or loop the relay: each finding of issue 70 mounted on the
real servers, through the door it came in by (a writer's own SQL, its own ``emit_events``, a
stranger's WAL message), with other outboxes' and other writers' events beside it.

What cannot be handled becomes that event's dead letter, with a reason naming the field; the
relay goes on, every other event is delivered once, and the WAL slot moves past every message.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox import capture
from outbox.capture.wal_message import KEPT_BYTES
from outbox.store.migrate import migrate
from tests.helpers import ModuleProcess, count, login_in, read_topic, wait_for


@pytest.fixture
def other_schema(pg_dsn: str) -> Iterator[str]:
    """A second outbox in the same database: one relay serves both."""
    name = f"o_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, name)
    yield name
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def _relay(dsn: str, kafka: str, *outboxes: str) -> ModuleProcess:
    named = [arg for i, s in enumerate(outboxes) for arg in ("--outbox", f"o{i}={dsn}#{s}")]
    return ModuleProcess(
        "outbox", "relay", *named, "--kafka-bootstrap", kafka, "--poll-interval", "0.1",
        "--retry-base", "0.05", "--retry-cap", "0.2",
    )  # fmt: skip


def _dead(dsn: str, schema: str) -> dict[str, tuple[str, str]]:
    """event id -> (kind, error) of the outbox's dead letters."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT event_id::text, kind, error FROM {}.dead_letters").format(sql.Identifier(schema))
        ).fetchall()
    return {e: (k, err) for e, k, err in rows}


def test_a_writers_fields_out_of_any_range_are_dead_letters_and_every_outbox_goes_on(
    pg_dsn: str, schema: str, other_schema: str, kafka: str, topic: str
) -> None:
    """Under the INSERT grant it has, a writer stores an expiry of -infinity (which ended every
    relay serving the outbox, the other outbox's included, at every start), 4713 BC, 294276 AD
    and infinity, a key too long for enqueue that compresses into the index, a topic too long for
    any broker and a type with a line break. The first two are expired dead letters, the next two
    are delivered, the last three corrupt dead letters naming their field; the relay stays up and
    the other outbox's events are delivered."""
    ids: dict[str, str] = {}
    with login_in(pg_dsn, schema, "writer") as writer, psycopg.connect(writer) as conn:
        insert = sql.SQL(
            "INSERT INTO {}.events (event_id, topic, key, payload, type, expires_at) "
            "VALUES (%s, %s, %s, 'x', %s, %s::timestamptz)"
        ).format(sql.Identifier(schema))
        rows = {
            "minus_infinity": (topic, b"k1", None, "-infinity"),
            "bc": (topic, b"k2", None, "4713-01-01 00:00:00+00 BC"),
            "far": (topic, b"k3", None, "294276-12-31 00:00:00+00"),
            "infinity": (topic, b"k4", None, "infinity"),
            "long_key": (topic, b"a" * 5000, None, None),
            "long_topic": ("t" * 1000, None, None, None),
            "type_crlf": (topic, None, "order\r\nX-Evil: 1", None),
        }
        for name, (t, key, type_, expires) in rows.items():
            ids[name] = str(uuid.uuid4())
            conn.execute(insert, (ids[name], t, key, type_, expires))
    with psycopg.connect(pg_dsn) as conn:
        other = str(outbox.enqueue(conn, topic, b"other outbox", key="k1", schema=other_schema))
    with _relay(pg_dsn, kafka, schema, other_schema) as relay:
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="the outbox drained")
        wait_for(lambda: count(pg_dsn, other_schema, "delivered") == 1, timeout=30, what="the other outbox")
        with psycopg.connect(pg_dsn) as conn:  # and one more, written while it runs
            later = str(outbox.enqueue(conn, topic, b"later", key="k9", schema=schema))
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 3, timeout=30, what="the later event")
        assert relay.proc.poll() is None, relay.output()
    dead = _dead(pg_dsn, schema)
    assert set(dead) == {ids[n] for n in ("minus_infinity", "bc", "long_key", "long_topic", "type_crlf")}
    assert (
        dead[ids["minus_infinity"]][0] == "expired"
        and "expires_at -infinity" in dead[ids["minus_infinity"]][1]
    )
    assert dead[ids["bc"]][0] == "expired" and "expires_at" in dead[ids["bc"]][1]
    for name, field in (
        ("long_key", "key: 5000 bytes"),
        ("long_topic", "topic: 1000"),
        ("type_crlf", "type:"),
    ):
        kind, error = dead[ids[name]]
        assert kind == "corrupt_event" and field in error, (name, error)
    got = {m.event_id for m in read_topic(kafka, topic, 4)}
    assert got == {ids["far"], ids["infinity"], other, later}


def _signed_message(event_id: str, topic: str, key: bytes | None = None, expires: Any = None) -> bytes:
    """A writer's own message for emit_events, as outbox.capture.wal_message encodes one (the
    expiry as the JSON text given)."""
    head = [event_id, topic, None if key is None else key.hex(), None, None]
    text = json.dumps(head, separators=(",", ":"))
    if expires is not None:
        text = text[:-1] + "," + expires + "]"
    return text.encode() + b"\n\n" + b"payload of " + event_id.encode()


def test_a_wal_transaction_whose_rows_postgres_refuses_is_written_back_row_by_row(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """One transaction of a writer's own emit_events holds a key too long for the key indexes, an
    expiry of 1e300 (to_timestamp refuses it), one of 1 and 400 zeros (float() overflows) and one
    of -1e300 (which ended the relay), beside good events of the writer; and an event the table
    refuses (a CHECK on its topic, as a trigger or a limit of PostgreSQL would). The write-back
    was one statement: it failed, the reader read the transaction again and the good events were
    sent without end. Now the refused fields are dead letters naming them, the good events are
    delivered once each, and the slot moves past the transaction."""
    bad_topic = f"{topic}.refused by the table"  # a space: Kafka refuses it for good (dead)
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER TABLE {}.events ADD CONSTRAINT refused CHECK (topic <> {})").format(
                sql.Identifier(wal_schema), sql.Literal(bad_topic)
            )
        )
    good = [str(uuid.uuid4()) for _ in range(3)]
    bad = {name: str(uuid.uuid4()) for name in ("key", "huge", "digits", "minus", "table")}
    messages = [
        _signed_message(good[0], topic, b"g"),
        _signed_message(bad["key"], topic, b"k" * 3000),
        _signed_message(bad["huge"], topic, b"g", "1e300"),
        _signed_message(good[1], topic, b"g"),
        _signed_message(bad["digits"], topic, None, "1" + "0" * 400),
        _signed_message(bad["minus"], topic, None, "-1e300"),
        _signed_message(bad["table"], bad_topic, None),
        _signed_message(good[2], topic, b"h"),
    ]
    with login_in(wal_dsn, wal_schema, "writer") as writer, psycopg.connect(writer) as conn:
        conn.execute(
            sql.SQL("SELECT {}.emit_events(%s::bytea[])").format(sql.Identifier(wal_schema)), (messages,)
        )
    with psycopg.connect(wal_dsn) as conn:
        after = str(outbox.enqueue(conn, topic, b"after", key="g", schema=wal_schema))
        end = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
    with _relay(wal_dsn, kafka, wal_schema) as relay:
        try:
            wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 4, timeout=30, what="the good events")
        except AssertionError:
            raise AssertionError(relay.output()[-5000:]) from None
        wait_for(lambda: count(wal_dsn, wal_schema, "dead_letters") == 5, timeout=30, what="the dead letters")
        wait_for(lambda: _confirmed_past(wal_dsn, wal_schema, end), timeout=30, what="the slot past them")
        time.sleep(1)  # a transaction read again would be sent again meanwhile
        assert relay.proc.poll() is None, relay.output()
        messages_got = read_topic(kafka, topic, 4)
    assert sorted(m.event_id for m in messages_got) == sorted([*good, after]), "sent once each"
    # A message that is no event is dead-lettered under a new id (its own may be forged), its
    # content kept as the payload: found here by the id inside it.
    with psycopg.connect(wal_dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT kind, error, payload FROM {}.dead_letters").format(sql.Identifier(wal_schema))
        ).fetchall()
    dead = {
        name: (kind, error)
        for kind, error, payload in rows
        for name, eid in bad.items()
        if eid.encode() in payload
    }
    assert set(dead) == set(bad) and len(rows) == len(bad), rows
    assert "key: 3000 bytes" in dead["key"][1]
    for name in ("huge", "digits", "minus"):
        assert "expires_at" in dead[name][1], dead[name]
    assert "PostgreSQL refused its topic" in dead["table"][1], dead["table"]
    assert all(kind == "corrupt_event" for kind, _ in dead.values())


def _confirmed_past(dsn: str, schema: str, lsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        slot = capture.state(conn, schema).slot
        row = conn.execute(
            "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
            (lsn, slot),
        ).fetchone()
    return bool(row and row[0])


def test_a_strangers_huge_messages_are_kept_as_a_bounded_prefix(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """A role that may only log in emits three 2 MB messages in one transaction (the finding was
    three of 380 MB: each kept whole as its dead letter's payload, bound as one array over the
    1 GB PostgreSQL takes in a message). Each dead letter keeps the first 64 KiB, and its reason
    the length and digest of the whole; the writer's event after them is delivered."""
    name = f"stranger_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        big = [bytes([i]) * (2 * 2**20) for i in range(1, 4)]
        with psycopg.connect(make_conninfo(wal_dsn, user=name)) as conn:
            for message in big:
                conn.execute(
                    "SELECT pg_logical_emit_message(true, %s, %s::bytea)",
                    (capture.prefix_of(wal_schema), message),
                )
        with psycopg.connect(wal_dsn) as conn:
            after = str(outbox.enqueue(conn, topic, b"after", schema=wal_schema))
        with _relay(wal_dsn, kafka, wal_schema) as relay:
            wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 1, timeout=60, what="the event after")
            assert relay.proc.poll() is None, relay.output()
        assert [m.event_id for m in read_topic(kafka, topic, 1)] == [after]
        with psycopg.connect(wal_dsn) as conn:
            rows = conn.execute(
                sql.SQL("SELECT kind, payload, error FROM {}.dead_letters ORDER BY id").format(
                    sql.Identifier(wal_schema)
                )
            ).fetchall()
        assert len(rows) == 3
        for (kind, payload, error), message in zip(rows, big, strict=True):
            assert kind == "unsigned_event" and bytes(payload) == message[:KEPT_BYTES]
            assert f"{len(message)} bytes, sha256 {hashlib.sha256(message).hexdigest()}" in error, error
    finally:
        with psycopg.connect(wal_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_a_delivered_wal_event_the_archive_refuses_is_archived_without_the_field_refused(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """Every event of the batch delivered (its archive, position and commit go in one round trip,
    pipelined) and the archive refuses one row (a CHECK of the operator's on its topic): the batch
    was read and sent again without end. Now the row is archived without the field refused, said
    in one log line; every event is sent once and the slot moves on."""
    refused = f"{topic}.refused"
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("ALTER TABLE {}.delivered ADD CONSTRAINT refused CHECK (topic <> {})").format(
                sql.Identifier(wal_schema), sql.Literal(refused)
            )
        )
    with psycopg.connect(wal_dsn) as conn:
        ids = [
            str(outbox.enqueue(conn, t, b"x", key="k", schema=wal_schema)) for t in (topic, refused, topic)
        ]
        end = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]  # type: ignore[index]
    with _relay(wal_dsn, kafka, wal_schema) as relay:
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 3, timeout=30, what="the archive")
        wait_for(lambda: _confirmed_past(wal_dsn, wal_schema, end), timeout=30, what="the slot past them")
        time.sleep(1)  # a batch read again would be sent again meanwhile
        assert relay.proc.poll() is None, relay.output()
        said = relay.output()
    got = read_topic(kafka, topic, 2) + read_topic(kafka, refused, 1)
    assert sorted(m.event_id for m in got) == sorted(ids), "sent once each"
    assert f"event {ids[1]} was delivered; PostgreSQL refused its topic in the archive" in said, said
    with psycopg.connect(wal_dsn) as conn:
        topics = dict(
            conn.execute(
                sql.SQL("SELECT event_id::text, topic FROM {}.delivered").format(sql.Identifier(wal_schema))
            ).fetchall()
        )
    assert topics == {ids[0]: topic, ids[1]: "(corrupt)", ids[2]: topic}
