"""CloudEvents in binary content mode, read back by the official SDK (``cloudevents``) through
its Kafka, HTTP and AMQP bindings, and checked header by header on NATS and Redis: every
attribute, from ``enqueue(type=, subject=)`` and the event itself. Off by default. Bad
``type``/``subject`` and bad options are refused naming the field."""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any

import psycopg
import pytest
from cloudevents.core.bindings import amqp as ce_amqp
from cloudevents.core.bindings import http as ce_http
from cloudevents.core.bindings import kafka as ce_kafka
from cloudevents.core.formats.json import JSONFormat
from psycopg import sql

import outbox
from outbox.cli import main
from outbox.errors import InvalidEvent, InvalidEventType
from outbox.relay.config import RelayConfig
from outbox.sinks.cloudevents import rfc3339
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from tests.helpers import Message, count, read_topic, running_relay, wait_for
from tests.sink_servers import SINKS, Target, target

SOURCE = "/orders-service"


def _enqueue_pair(dsn: str, schema: str, topic: str) -> tuple[uuid.UUID, uuid.UUID]:
    """One event with type and subject, one without (its type is the topic)."""
    with psycopg.connect(dsn) as conn:
        typed = outbox.enqueue(
            conn,
            topic,
            {"order": 1},
            key="o-1",
            type="com.example.order.created",
            subject="orders/1",
            schema=schema,
        )
        [plain] = outbox.enqueue_many(
            conn, [{"topic": topic, "payload": {"order": 2}, "key": "o-2"}], schema=schema
        )
        conn.commit()
    return typed, plain


def _created(dsn: str, schema: str) -> dict[str, str]:
    """event id -> created_at as the relay formats it."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT event_id::text, extract(epoch FROM created_at)::float8 FROM {}.delivered").format(
                sql.Identifier(schema)
            )
        ).fetchall()
    return {e: rfc3339(t) for e, t in rows}


def _relay(dsn: str, schema: str, url: str, *, source: str | None = SOURCE, n: int = 2) -> None:
    config = RelayConfig(dsn, schema=schema, poll_interval=0.1, delivery_timeout=5.0)
    factory = routed(parse_routes([f"*={url}"], None), config.delivery_timeout, cloudevents_source=source)
    with running_relay(config, factory):
        wait_for(lambda: count(dsn, schema, "delivered") == n, timeout=30, what="delivery")


def _check(event: Any, expected_id: str, created: str, typed: bool, topic: str) -> None:
    assert event.get_id() == expected_id
    assert event.get_source() == SOURCE
    assert event.get_specversion() == "1.0"
    assert event.get_datacontenttype() == "application/json"
    assert event.get_time() == dt.datetime.fromisoformat(created.replace("Z", "+00:00"))
    if typed:
        assert event.get_type() == "com.example.order.created"
        assert event.get_subject() == "orders/1"
        assert event.get_data() == {"order": 1}
    else:
        assert event.get_type() == topic
        assert event.get_subject() is None
        assert event.get_data() == {"order": 2}


def test_kafka_messages_parse_as_cloudevents_with_every_attribute(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    typed, plain = _enqueue_pair(pg_dsn, schema, topic)
    _relay(pg_dsn, schema, f"kafka://{kafka}")
    created = _created(pg_dsn, schema)
    for m in read_topic(kafka, topic, 2):
        headers = {k: v for k, v in m.headers.items()}
        assert headers["ce_id"] == headers["event-id"]
        event = ce_kafka.from_binary(ce_kafka.KafkaMessage(headers, m.key, m.value), JSONFormat())
        _check(event, m.event_id, created[m.event_id], m.event_id == str(typed), topic)
        assert event.get_extension("partitionkey") == m.key.decode()  # type: ignore[union-attr]
    assert {str(typed), str(plain)} == set(created)


def test_off_by_default_no_cloudevents_headers(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    _enqueue_pair(pg_dsn, schema, topic)
    _relay(pg_dsn, schema, f"kafka://{kafka}", source=None)
    for m in read_topic(kafka, topic, 2):
        assert not [h for h in m.headers if h.startswith("ce_")]


def _parse(sink: Target, m: Message) -> Any:
    """The message through the SDK binding of its protocol, or by hand where the SDK has none."""
    headers = {k: v.decode() for k, v in m.headers.items()}
    if sink.scheme == "http":
        return ce_http.from_binary(ce_http.HTTPMessage(headers, m.value), JSONFormat())
    if sink.scheme == "amqp":
        properties = {"content-type": headers["x-content-type"]}
        app = {k: v for k, v in headers.items() if k.startswith("cloudEvents:")}
        attributes = {"id", "source", "specversion", "type", "time"} | (
            {"subject"} if "orders/1" in app.values() else set()
        )
        assert set(app) == {f"cloudEvents:{a}" for a in attributes}
        return ce_amqp.from_binary(ce_amqp.AMQPMessage(properties, app, m.value), JSONFormat())
    # NATS (ce- headers, the Go SDK's binary mode) and Redis (ce_, as Kafka): the SDK has no
    # binding for either; the Kafka binding reads ce_ names, so map NATS's to it for parsing.
    prefix = "ce-" if sink.scheme == "nats" else "ce_"
    assert headers[prefix + "id"] == headers["event-id"]
    mapped = {
        ("ce_" + k[len(prefix) :] if k.startswith(prefix) else k): v.encode() for k, v in headers.items()
    }
    return ce_kafka.from_binary(ce_kafka.KafkaMessage(mapped, None, m.value), JSONFormat())


@pytest.mark.parametrize("scheme", SINKS)
def test_every_sink_carries_the_attributes_in_its_binding(pg_dsn: str, schema: str, scheme: str) -> None:
    sink = target(scheme)
    try:
        typed, _ = _enqueue_pair(pg_dsn, schema, sink.topic)
        _relay(pg_dsn, schema, sink.url())
        created = _created(pg_dsn, schema)
        got = sink.read(2)
        assert len(got) == 2
        for m in got:
            _check(_parse(sink, m), m.event_id, created[m.event_id], m.event_id == str(typed), sink.topic)
    finally:
        sink.close()


def test_type_and_subject_survive_replay_and_are_validated(pg_dsn: str, schema: str, capsys: Any) -> None:
    with psycopg.connect(pg_dsn) as conn:
        with pytest.raises(InvalidEventType, match=r"^type: expected str or None, got int"):
            outbox.enqueue(conn, "t", b"x", type=5, schema=schema)  # type: ignore[arg-type]
        with pytest.raises(InvalidEvent, match=r"^subject: must be printable text"):
            outbox.enqueue(conn, "t", b"x", subject="a\nb", schema=schema)
        with pytest.raises(InvalidEvent, match=r"^events\[1\]\.type: must not be empty"):
            outbox.enqueue_many(
                conn, [{"topic": "t", "payload": 1}, {"topic": "t", "payload": 2, "type": ""}], schema=schema
            )
        with pytest.raises(InvalidEvent, match=r"^type: 256 characters long, at most 255"):
            outbox.enqueue(conn, "t", b"x", type="x" * 256, schema=schema)
        outbox.enqueue(conn, "t", b"x", type="com.example.t", subject="s/1", schema=schema)
        conn.commit()
        conn.execute(
            sql.SQL(
                "WITH d AS (DELETE FROM {s}.events RETURNING *) INSERT INTO {s}.delivered "
                "(id, event_id, topic, key, payload, headers, created_at, attempts, type, subject) "
                "SELECT id, event_id, topic, key, payload, headers, created_at, 1, type, subject FROM d"
            ).format(s=sql.Identifier(schema))
        )
        conn.commit()
    assert main(["replay", "--dsn", pg_dsn, "--schema", schema, "--since", "1h", "--yes"]) == 0
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT type, subject FROM {}.events").format(sql.Identifier(schema))
        ).fetchall()
    assert rows == [("com.example.t", "s/1")]


def test_cli_refuses_cloudevents_options_that_do_not_fit(pg_dsn: str, schema: str, capsys: Any) -> None:
    base = ["relay", "--dsn", pg_dsn, "--schema", schema, "--kafka-bootstrap", "127.0.0.1:1"]
    assert main([*base, "--cloudevents"]) == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(
            "--cloudevents-source: required with --cloudevents, a URI-reference such as /orders-service"
        )
    )
    assert main([*base, "--cloudevents-source", "/x"]) == 2
    assert "--cloudevents-source: given without --cloudevents" in capsys.readouterr().err
    assert main([*base, "--cloudevents", "--cloudevents-source", "not a uri"]) == 2
    assert "--cloudevents-source: a URI-reference has no spaces" in capsys.readouterr().err


# Text a header carries raw only by luck: space, '"', '%', non-ASCII, an escape's look-alike.
AWKWARD = ["a b", "100%", 'say "hi"', "café", "a%20b", "€😀", "orders/1"]


@pytest.mark.parametrize("scheme", ["http", "kafka"])
def test_awkward_subjects_and_types_arrive_as_written_through_the_sdk(
    pg_dsn: str, schema: str, kafka: str, scheme: str
) -> None:
    """HTTP binding 1.0, 3.1.3.2: a ce- header's value is percent-encoded (space, '"', '%' and all
    outside U+0021-U+007E); the SDK decodes it back. Kafka's binding carries the bytes as they
    are. Either way the SDK reads back exactly what was written."""
    sink = target("http") if scheme == "http" else None
    topic = sink.topic if sink is not None else f"ce-{uuid.uuid4().hex[:8]}"
    written: dict[str, tuple[str, str]] = {}
    with psycopg.connect(pg_dsn) as conn:
        for i, text in enumerate(AWKWARD):
            event_type = f"com.example.{text}"
            eid = outbox.enqueue(
                conn, topic, {"n": i}, key=f"k{i}", type=event_type, subject=text, schema=schema
            )
            written[str(eid)] = (event_type, text)
        conn.commit()
    try:
        _relay(pg_dsn, schema, sink.url() if sink is not None else f"kafka://{kafka}", n=len(AWKWARD))
        if sink is not None:
            events = [_parse(sink, m) for m in sink.read(len(AWKWARD))]
        else:
            events = [
                ce_kafka.from_binary(ce_kafka.KafkaMessage(dict(m.headers), m.key, m.value), JSONFormat())
                for m in read_topic(kafka, topic, len(AWKWARD))
            ]
    finally:
        if sink is not None:
            sink.close()
    got = {e.get_id(): (e.get_type(), e.get_subject()) for e in events}
    assert got == written
