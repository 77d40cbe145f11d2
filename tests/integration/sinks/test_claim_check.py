"""Claim-check: 5 MB payloads through Kafka (PostgreSQL store) and through a webhook (an
S3-compatible store: moto in server mode, started here on a loopback port), mixed with small
events of the same keys in order; the consumer sees the original bytes; the store down for a
while and back loses nothing; purge deletes what it stored; status shows the bytes held.

What moto proves: the S3 calls (put, get, list, delete) are well-formed and the error paths
of a store that is unreachable or lost its bucket are retried. What it does not: real S3's
latency, multipart limits, IAM policies and eventual listing behaviour of other stores."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.cli import main
from outbox.inbox import Delivery, consume_kafka
from outbox.relay.config import RelayConfig
from outbox.relay.retry import RetryPolicy
from outbox.sinks.claim_check import HEADER, PostgresStore, S3Store, fetch
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from tests.aws_servers import Moto
from tests.helpers import count, read_topic, running_relay, wait_for
from tests.inbox_consumer import GROUP_SETTINGS
from tests.sink_servers import HttpTarget

BIG = 5 * 2**20
OVER = 1_000_000
KEYS = 3
PER_KEY = 6  # every third event of a key is big


@pytest.fixture
def moto(monkeypatch: pytest.MonkeyPatch) -> Iterator[Moto]:
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    server = Moto().start()
    server.bucket("payloads")
    yield server
    server.stop()


def _events(topic: str) -> list[dict[str, Any]]:
    """KEYS keys x PER_KEY events; every third is a 5 MB random payload, the rest small JSON."""
    out = []
    for seq in range(PER_KEY):
        for k in range(KEYS):
            big = seq % 3 == 1
            payload: Any = os.urandom(BIG) if big else {"k": k, "seq": seq}
            out.append({"topic": topic, "key": f"k{k}", "payload": payload, "headers": {"seq": str(seq)}})
    return out


def _enqueue(dsn: str, schema: str, events: list[dict[str, Any]]) -> dict[str, bytes]:
    """event id -> the payload bytes the writer stored."""
    with psycopg.connect(dsn) as conn:
        ids = outbox.enqueue_many(conn, events, schema=schema)
        conn.commit()
        rows = conn.execute(
            sql.SQL("SELECT event_id::text, payload FROM {}.events").format(sql.Identifier(schema))
        ).fetchall()
    assert len(ids) == len(rows)
    return {e: bytes(p) for e, p in rows}


def _config(dsn: str, schema: str) -> RelayConfig:
    fast = RetryPolicy(base=0.05, cap=0.5, max_attempts=1000)
    return RelayConfig(dsn, schema=schema, poll_interval=0.1, delivery_timeout=10.0, lease=30.0, retry=fast)


def _assert_key_order(seqs: list[tuple[str, int]]) -> None:
    last: dict[str, int] = {}
    for key, seq in seqs:
        assert seq > last.get(key, -1), f"key {key}: seq {seq} after {last.get(key)}"
        last[key] = seq


def test_big_payloads_go_by_reference_through_kafka_in_key_order_and_the_consumer_gets_the_bytes(
    pg_dsn: str, schema: str, kafka: str, topic: str, capsys: Any
) -> None:
    sent = _enqueue(pg_dsn, schema, _events(topic))
    config = _config(pg_dsn, schema)
    store = PostgresStore(pg_dsn, schema)
    factory = routed(
        parse_routes([f"*=kafka://{kafka}"], None), config.delivery_timeout, claim_check=(store, OVER)
    )
    with running_relay(config, factory):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == len(sent), timeout=60, what="delivery")
    messages = read_topic(kafka, topic, len(sent))
    assert len(messages) == len(sent)
    big = [m for m in messages if HEADER in m.headers]
    assert len(big) == KEYS * 2 and all(m.value == b"" for m in big)
    assert all(m.headers[HEADER] == f"postgres:{schema}/{m.event_id}".encode() for m in big)
    assert all(m.headers["seq"] in (b"1", b"4") for m in big), "only the big ones went by reference"
    for m in messages:  # small ones unchanged, big ones resolvable, byte-exact
        value = (
            outbox.inbox.fetch_claim_check(m.headers[HEADER], store=f"postgres:{schema}", dsn=pg_dsn)
            if HEADER in m.headers
            else m.value
        )
        assert value == sent[m.event_id]
    _assert_key_order([(m.key.decode(), int(m.headers["seq"])) for m in messages])  # type: ignore[union-attr]

    # The consumer loop resolves references before the handler sees the message.
    seen: list[tuple[str, int, str]] = []

    def handler(conn: psycopg.Connection[Any], d: Delivery) -> None:
        seen.append((d.key.decode(), int(d.headers["seq"]), hashlib.sha256(d.value).hexdigest()))  # type: ignore[union-attr, arg-type]

    stop = threading.Event()
    runner = threading.Thread(
        target=consume_kafka,
        args=({"bootstrap.servers": kafka, "group.id": f"g-{topic}", **GROUP_SETTINGS}, [topic], handler),
        kwargs={"dsn": pg_dsn, "schema": schema, "stop": stop},
    )
    runner.start()
    try:
        wait_for(lambda: len(seen) == len(sent), timeout=60, what="the consumer")
    finally:
        stop.set()
        runner.join(30)
    assert sorted(h for _, _, h in seen) == sorted(hashlib.sha256(p).hexdigest() for p in sent.values())
    _assert_key_order([(k, s) for k, s, _ in seen])

    assert main(["status", "--dsn", pg_dsn, "--schema", schema, "--json"]) == 0
    held = json.loads(capsys.readouterr().out)["claim_checks"]
    assert held == {"store": f"postgres:{schema}", "payloads": KEYS * 2, "bytes": KEYS * 2 * BIG}
    store.close()


def test_a_big_payload_through_a_webhook_by_s3_reference(pg_dsn: str, schema: str, moto: Moto) -> None:
    target = HttpTarget()
    try:
        payload = os.urandom(BIG)
        with psycopg.connect(pg_dsn) as conn:
            event_id = str(outbox.enqueue(conn, target.topic, payload, key="k", schema=schema))
            outbox.enqueue(conn, target.topic, {"small": True}, key="k", schema=schema)
            conn.commit()
        config = _config(pg_dsn, schema)
        store = S3Store(f"s3://payloads/outbox?endpoint={moto.endpoint}&region=us-east-1")
        factory = routed(
            parse_routes([f"*={target.url()}"], None), config.delivery_timeout, claim_check=(store, OVER)
        )
        with running_relay(config, factory):
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 2, timeout=60, what="delivery")
        got = target.read(2)
        big, small = got
        day = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
        assert big.headers[HEADER] == f"s3://payloads/outbox/{day}/{event_id}".encode()
        assert big.value == b"" and json.loads(small.value) == {"small": True}
        assert fetch(big.headers[HEADER], store="s3://payloads/outbox", endpoint=moto.endpoint) == payload
        assert store.held() == (1, BIG)
    finally:
        target.close()


def test_the_store_down_then_back_loses_nothing_and_keeps_key_order(
    pg_dsn: str, schema: str, kafka: str, topic: str, moto: Moto
) -> None:
    moto.stop()
    sent = _enqueue(pg_dsn, schema, _events(topic))
    config = _config(pg_dsn, schema)
    store = S3Store(f"s3://payloads?endpoint={moto.endpoint}&region=us-east-1")
    factory = routed(
        parse_routes([f"*=kafka://{kafka}"], None), config.delivery_timeout, claim_check=(store, OVER)
    )
    with running_relay(config, factory) as relay:
        wait_for(
            lambda: count(pg_dsn, schema, "events", "last_error LIKE 'claim-check store%'") >= KEYS,
            timeout=60,
            what="big events retrying while the store is down",
        )
        time.sleep(1.0)
        # Each key's first event (small) went out; its big second event and all after it wait.
        assert count(pg_dsn, schema, "delivered") == KEYS
        assert count(pg_dsn, schema, "dead_letters") == 0, "a store outage never dead-letters"
        moto.start()  # back, but empty (in memory): NoSuchBucket is retried too
        time.sleep(1.0)
        moto.bucket("payloads")
        wait_for(
            lambda: count(pg_dsn, schema, "delivered") == len(sent), timeout=60, what="drain after the store"
        )
        # Counted once the batch is recorded, a moment after its commit made the rows visible.
        wait_for(lambda: relay.stats.delivered == len(sent), timeout=10, what="the relay's count")
    messages = read_topic(kafka, topic, len(sent))
    assert len({m.event_id for m in messages}) == len(sent)
    for m in messages:
        value = (
            fetch(m.headers[HEADER], store="s3://payloads", endpoint=moto.endpoint)
            if HEADER in m.headers
            else m.value
        )
        assert value == sent[m.event_id]
    _assert_key_order([(m.key.decode(), int(m.headers["seq"])) for m in messages])  # type: ignore[union-attr]


def test_purge_deletes_stored_payloads_of_the_purged_days(
    pg_dsn: str, schema: str, moto: Moto, capsys: Any
) -> None:
    pg = PostgresStore(pg_dsn, schema)
    pg.put("00000000-0000-0000-0000-000000000001", b"old")
    pg.put("00000000-0000-0000-0000-000000000002", b"new")
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "UPDATE {}.claim_checks SET stored_at = now() - interval '3 days' WHERE payload = 'old'"
            ).format(sql.Identifier(schema))
        )
        conn.commit()
    url = f"s3://payloads/p?endpoint={moto.endpoint}&region=us-east-1"
    s3 = S3Store(url)
    s3.put("e-new", b"new")
    old_day = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=3)).date()
    s3._client.put_object(Bucket="payloads", Key=s3._key("e-old", old_day), Body=b"old")
    assert s3.held() == (2, 6)

    assert main(["purge", "--dsn", pg_dsn, "--schema", schema, "--older-than", "1d", "--yes"]) == 0
    assert "and 1 claim-check payloads (postgres:" in capsys.readouterr().out
    assert pg.held() == (1, 3)
    assert main(["purge", "--dsn", pg_dsn, "--schema", schema, "--older-than", "1d", "--yes",
                 "--claim-check-store", url]) == 0  # fmt: skip
    assert "and 1 claim-check payloads (s3://payloads/p)" in capsys.readouterr().out
    assert s3.held() == (1, 3)
    assert main(["status", "--dsn", pg_dsn, "--schema", schema, "--claim-check-store", url]) == 0
    assert "claim-check store    1 payloads" in capsys.readouterr().out
    pg.close()
    s3.close()


def test_claim_check_options_are_checked(pg_dsn: str, schema: str, kafka: str, capsys: Any) -> None:
    base = ["relay", "--dsn", pg_dsn, "--schema", schema, "--kafka-bootstrap", kafka]
    assert main([*base, "--claim-check-over", "1000"]) == 2
    assert "--claim-check-over: needs --claim-check-store too" in capsys.readouterr().err
    assert main([*base, "--claim-check-over", "0", "--claim-check-store", "postgres:"]) == 2
    assert "--claim-check-over: must be >= 1 byte" in capsys.readouterr().err
    assert main([*base, "--claim-check-over", "10", "--claim-check-store", "ftp://x"]) == 2
    assert "--claim-check-store: expected postgres: or s3://BUCKET/PREFIX" in capsys.readouterr().err
    assert main([*base, "--claim-check-over", "10", "--claim-check-store", "s3://key:secret@bucket/p"]) == 2
    err = capsys.readouterr().err
    assert "put no credentials in the URL" in err and "secret" not in err.replace("AWS_SECRET", "")
