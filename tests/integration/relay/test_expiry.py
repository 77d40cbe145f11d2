"""Expiry (``enqueue(..., expires_at=)``): an event claimed at or after its expiry is not sent,
but dead-lettered with the kind ``expired``, which never parks its key. Provoked by a broker
outage on both captures; counted, shown by ``outbox status``, and redriven only when asked."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

import outbox
from outbox.cli import main
from outbox.harness.embedded import Broker
from outbox.operate import status
from outbox.relay.relay import RelayConfig
from tests.helpers import count, first_occurrences, http_get, read_topic, running_relay, wait_for

SOON = 2.0  # seconds: the expiry of the events that must expire during the outage


def _write(dsn: str, schema: str, topic: str) -> dict[str, str]:
    now = datetime.now(timezone.utc)
    soon, later = now + timedelta(seconds=SOON), now + timedelta(hours=1)
    rows: list[tuple[str, dict[str, Any]]] = [
        ("k1_expires", {"key": "k", "expires_at": soon}),
        ("k2_plain", {"key": "k"}),
        ("k3_later", {"key": "k", "expires_at": later}),
        ("j1_expires", {"key": "j", "expires_at": soon}),
        ("none_expires", {"expires_at": soon}),
        ("none_later", {"expires_at": later}),
    ]
    with psycopg.connect(dsn) as conn:
        ids = outbox.enqueue_many(
            conn, [{"topic": topic, "payload": {"name": n}, **extra} for n, extra in rows], schema=schema
        )
    return {name: str(i) for (name, _), i in zip(rows, ids, strict=True)}


@pytest.mark.parametrize("capture", ["table", "wal"])
def test_what_expires_during_an_outage_is_dead_never_sent_and_parks_nothing(
    request: pytest.FixtureRequest, capture: str, own_broker: Broker, topic: str
) -> None:
    dsn: str = request.getfixturevalue("pg_dsn" if capture == "table" else "wal_dsn")
    schema: str = request.getfixturevalue("schema" if capture == "table" else "wal_schema")
    own_broker.stop()
    config = RelayConfig(
        dsn,
        schema=schema,
        delivery_timeout=1.0,
        lease=5.0,
        poll_interval=0.1,
        metrics_port=0,
        retry=outbox.RetryPolicy(base=0.2, cap=0.5, max_attempts=1000),
    )
    with running_relay(config, bootstrap=own_broker.bootstrap) as relay:
        ids = _write(dsn, schema, topic)
        # Sent and failed while the broker is down (WAL capture: then kept in the table).
        wait_for(
            lambda: count(dsn, schema, "events", "attempts > 0") >= 3, timeout=30, what="failed attempts"
        )
        wait_for(
            lambda: count(dsn, schema, "dead_letters") == 3, timeout=30, what="the expired dead-lettered"
        )
        own_broker.start()
        wait_for(lambda: count(dsn, schema, "events") == 0, timeout=60, what="the rest delivered")
        assert relay.http is not None
        _, text = http_get(relay.http.port, "/metrics")
    expired = {ids["k1_expires"], ids["j1_expires"], ids["none_expires"]}
    with psycopg.connect(dsn) as conn:
        dead = conn.execute(
            f'SELECT event_id::text, kind, parked, error, expires_at FROM "{schema}".dead_letters'
        ).fetchall()
        report = status.collect(conn, schema)
    assert {d[0] for d in dead} == expired
    for _, kind, parked, error, expires_at in dead:
        assert (kind, parked) == ("expired", False), "an expired event never parks its key"
        assert expires_at is not None
        assert re.fullmatch(r"expires_at \S+ passed before it was sent \(claimed at \S+\)", error), error
    messages = first_occurrences(read_topic(own_broker.bootstrap, topic, 3))
    assert {m.event_id for m in messages} == {ids["k2_plain"], ids["k3_later"], ids["none_later"]}
    order = [m.event_id for m in messages if m.key == b"k"]
    assert order == [ids["k2_plain"], ids["k3_later"]], "the key went on after its expired event"
    samples = re.findall(r'^outbox_expired_total\{outbox="default",topic="([^"]+)"\} (\S+)$', text, re.M)
    assert samples == [(topic, "3")]
    assert report["expired"] == 3 and "dead letters         3 (3 expired)" in status.render(report)


def test_an_expired_dead_letter_is_redriven_only_when_asked_and_then_delivered(
    pg_dsn: str, schema: str, kafka: str, topic: str, capsys: pytest.CaptureFixture[str]
) -> None:
    past = datetime.now(timezone.utc) - timedelta(seconds=1)
    with psycopg.connect(pg_dsn) as conn:
        (late,) = outbox.enqueue_many(
            conn, [{"topic": topic, "payload": b"late", "expires_at": past}], schema=schema
        )
        conn.execute(
            f'INSERT INTO "{schema}".events (event_id, topic, payload) VALUES (gen_random_uuid(), %s, %s)',
            (topic, b"x"),
        )
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1)
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="the drain")
    assert count(pg_dsn, schema, "dead_letters", "kind = 'expired'") == 1
    base = ["dead", "redrive", "--dsn", pg_dsn, "--schema", schema, "--yes"]
    capsys.readouterr()
    assert main([*base, "--all"]) == 1
    assert capsys.readouterr().err == (
        "outbox: error: no dead letter matches but 1 that expired (--include-expired to redrive them, late)\n"
    )
    assert count(pg_dsn, schema, "dead_letters") == 1, "a bulk redrive leaves an expired dead letter"
    assert main(["dead", "list", "--dsn", pg_dsn, "--schema", schema]) == 0
    assert "(expired: --include-expired to redrive)" in capsys.readouterr().out
    assert main([*base, "--all", "--include-expired"]) == 0
    assert count(pg_dsn, schema, "dead_letters") == 0
    assert count(pg_dsn, schema, "events", "expires_at IS NULL") == 1, "back without its expiry"
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="the redriven one")
    assert str(late) in {m.event_id for m in read_topic(kafka, topic, 2)}
    with psycopg.connect(pg_dsn) as conn:
        action = conn.execute(f'SELECT selector FROM "{schema}".audit ORDER BY id DESC LIMIT 1').fetchone()
    assert action is not None and action[0].get("include_expired") is True
