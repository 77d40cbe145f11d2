"""`outbox verify` on the real brokers: a sink that really lost events (a Tansu restart on memory
storage, a JetStream message deleted, a Redis Streams entry deleted) is reported missing by the
exact ids, a log trimmed at its start is reported expired, and `--repair` sends the missing again
under their own event ids: delivered, consumed, and a second verify finds nothing missing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import nats
import nats.js.errors
import psycopg
import pytest
import redis

import outbox
from outbox.harness.embedded import Broker, free_port
from outbox.relay.relay import RelayConfig
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from tests.aws_servers import KinesisTarget, Moto
from tests.helpers import FAST, ModuleProcess, count, http_get, read_topic, running_relay, wait_for
from tests.sink_servers import NatsTarget, RedisTarget

N = 12  # events per test: keys k0..k2, four each


def _write(dsn: str, schema: str, topic: str, n: int = N) -> list[str]:
    with psycopg.connect(dsn) as conn:
        return [str(outbox.enqueue(conn, topic, {"n": i}, key=f"k{i % 3}", schema=schema)) for i in range(n)]


def _deliver(dsn: str, schema: str, route: str, archived: int) -> None:
    """A relay on ``route`` until ``archived`` events are archived and none is pending."""
    config = RelayConfig(dsn, schema=schema, poll_interval=0.1, delivery_timeout=5.0)
    with running_relay(config, routed(parse_routes([route], None), config.delivery_timeout)):
        wait_for(lambda: count(dsn, schema, "delivered") >= archived, timeout=30, what="delivered")
        wait_for(lambda: count(dsn, schema, "events") == 0, timeout=30, what="nothing pending")


def _verify(dsn: str, schema: str, route: str, *args: str) -> tuple[int, dict[str, Any], str]:
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "verify", "--dsn", dsn, "--schema", schema, "--route", route,
         "--since", "1h", "--json", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode in (0, 1), done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, json.loads(done.stdout), done.stderr


def _sink_ref(dsn: str, schema: str, event_id: str) -> tuple[Any, ...]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            f'SELECT sink_partition, sink_offset, sink_ref FROM "{schema}".delivered '
            "WHERE event_id = %s ORDER BY delivered_at DESC LIMIT 1",
            (event_id,),
        ).fetchone()
    assert row is not None
    return tuple(row)


def _repair_then_verify(
    dsn: str, schema: str, route: str, lost: list[str], total: int, mended: Callable[[], Any] = lambda: None
) -> None:
    """--repair queues exactly ``lost`` under their own ids; once the sink is ``mended`` and the
    relay delivers them, a second verify finds nothing missing; the audit trail records the repair."""
    code, report, _ = _verify(dsn, schema, route, "--repair")
    mended()
    assert code == 1 and sorted(report["missing"]) == sorted(lost) and report["repaired"] == len(lost)
    with psycopg.connect(dsn) as conn:
        queued = [str(r[0]) for r in conn.execute(f'SELECT event_id FROM "{schema}".events ORDER BY id')]
        [(action, done)] = conn.execute(f'SELECT action, done FROM "{schema}".audit').fetchall()
    assert sorted(queued) == sorted(lost) and (action, done) == ("repair", len(lost))
    _deliver(dsn, schema, route, total + len(lost))
    code, report, _ = _verify(dsn, schema, route)
    assert code == 0 and report["missing"] == [], report
    assert report["checked"] == total  # the lost deliveries are replaced by the repaired ones


def test_redis_streams_an_entry_deleted_is_missing_one_trimmed_is_expired_and_repair_restores_it(
    pg_dsn: str, schema: str
) -> None:
    target = RedisTarget()
    route = f"*={target.url()}"
    try:
        ids = _write(pg_dsn, schema, target.topic)
        _deliver(pg_dsn, schema, route, N)
        code, report, _ = _verify(pg_dsn, schema, route)
        assert (code, report["present"], report["missing"]) == (0, N, [])
        client = redis.Redis(host="127.0.0.1", port=6379)
        entries = [entry for entry, _ in client.xrange(target.topic)]
        client.xdel(target.topic, entries[5])  # in the middle: lost
        client.xtrim(target.topic, minid=entries[2], approximate=False)  # the first two: trimmed
        deleted = next(e for e in ids if _sink_ref(pg_dsn, schema, e)[2] == entries[5].decode())
        code, report, _ = _verify(pg_dsn, schema, route)
        assert (code, report["missing"], report["expired"], report["present"]) == (1, [deleted], 2, N - 3)
        _repair_then_verify(pg_dsn, schema, route, [deleted], N)
        arrived = [m.headers["event-id"].decode() for m in target.fetch()]
        assert arrived.count(deleted) == 1 and len(arrived) == N - 2
    finally:
        target.close()


def test_jetstream_a_deleted_message_is_missing_a_purged_start_is_expired_and_repair_restores_it(
    pg_dsn: str, schema: str
) -> None:
    target = NatsTarget()
    route = f"*={target.url()}"
    try:
        ids = _write(pg_dsn, schema, target.topic)
        _deliver(pg_dsn, schema, route, N)
        by_seq = {_sink_ref(pg_dsn, schema, e)[1]: e for e in ids}

        async def lose() -> None:
            nc = await nats.connect(target.url())
            js = nc.jetstream()
            await js.delete_msg(target.stream, 7)  # in the middle: lost
            await js.purge_stream(target.stream, seq=3)  # below sequence 3: the stream's own purge
            await nc.close()

        asyncio.run(lose())
        code, report, _ = _verify(pg_dsn, schema, route)
        assert (code, report["missing"], report["expired"], report["present"]) == (1, [by_seq[7]], 2, N - 3)
        _repair_then_verify(pg_dsn, schema, route, [by_seq[7]], N)

        async def consume() -> list[str]:  # what a consumer reads now: sequence 7 is a gap
            nc = await nats.connect(target.url())
            js = nc.jetstream()
            info = await js.stream_info(target.stream)
            out = []
            for seq in range(info.state.first_seq, info.state.last_seq + 1):
                with contextlib.suppress(nats.js.errors.NotFoundError):
                    out.append((await js.get_msg(target.stream, seq)).headers["event-id"])
            await nc.close()
            return out

        arrived = asyncio.run(consume())
        assert arrived.count(by_seq[7]) == 1 and len(arrived) == N - 2
    finally:
        target.close()


@pytest.fixture
def broker() -> Iterator[Broker]:
    broker = Broker().start()
    yield broker
    broker.stop()


def test_kafka_a_broker_restarted_on_memory_storage_lost_everything_and_repair_sends_it_again(
    pg_dsn: str, schema: str, broker: Broker, topic: str
) -> None:
    route = f"*=kafka://{broker.bootstrap}"
    ids = _write(pg_dsn, schema, topic)
    _deliver(pg_dsn, schema, route, N)
    code, report, _ = _verify(pg_dsn, schema, route)
    assert (code, report["present"]) == (0, N), report
    broker.stop()
    broker.start()  # memory storage: every acknowledged write is gone
    code, report, _ = _verify(pg_dsn, schema, route)
    assert code == 1 and sorted(report["missing"]) == sorted(ids) and report["present"] == 0
    _repair_then_verify(pg_dsn, schema, route, ids, N)
    messages = read_topic(broker.bootstrap, topic, N)
    assert sorted(m.event_id for m in messages) == sorted(ids)
    for key in ("k0", "k1", "k2"):  # in order per key, as first written
        ns = [json.loads(m.value)["n"] for m in messages if m.key == key.encode()]
        assert ns == sorted(ns)


def test_unverifiable_sinks_are_counted_not_missing(pg_dsn: str, schema: str, topic: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".delivered (id, event_id, topic, payload, headers, created_at, attempts) '
            "VALUES (1, gen_random_uuid(), %s, '\\x7b7d', '{}', now(), 1)",
            (topic,),
        )
    code, report, _ = _verify(pg_dsn, schema, "*=amqp://guest:guest@127.0.0.1:5672/")
    assert (code, report["checked"], report["unverifiable"], report["missing"]) == (0, 1, 1, [])


def test_a_sink_that_cannot_be_read_is_one_line_and_no_verdict(pg_dsn: str, schema: str, topic: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'INSERT INTO "{schema}".delivered (id, event_id, topic, payload, headers, created_at, attempts, '
            "sink_ref) VALUES (1, gen_random_uuid(), %s, '\\x7b7d', '{}', now(), 1, '1-0')",
            (topic,),
        )
    done = subprocess.run(
        [sys.executable, "-m", "outbox", "verify", "--dsn", pg_dsn, "--schema", schema,
         "--route", "*=redis://:s3cret@127.0.0.1:1/0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and done.stdout == "", done
    assert done.stderr.count("\n") == 1 and "redis://127.0.0.1:1/0 cannot be read back" in done.stderr
    assert "s3cret" not in done.stderr and "Traceback" not in done.stderr
    with psycopg.connect(pg_dsn) as conn:  # no verdict recorded
        assert conn.execute(f'SELECT count(*) FROM "{schema}".verifications').fetchone() == (0,)


@pytest.mark.parametrize("envelope", [False, True], ids=["plain", "envelope"])
def test_kinesis_on_moto_a_restart_lost_the_stream_and_repair_sends_it_again(
    pg_dsn: str, schema: str, moto_server: Moto, aws_env: dict[str, str], envelope: bool
) -> None:
    """Plain records carry no event id: the sequence number is the event's, its payload and
    partition key what must be there; with ``envelope=json`` the envelope's id is compared."""
    target = KinesisTarget(moto_server, envelope=envelope)
    route = f"*={target.url()}"
    ids = _write(pg_dsn, schema, f"t-{uuid.uuid4().hex[:8]}")
    _deliver(pg_dsn, schema, route, N)
    code, report, _ = _verify(pg_dsn, schema, route)
    assert (code, report["present"]) == (0, N), report
    moto_server.stop()
    moto_server.start()  # in memory: the stream and every record are gone
    code, report, _ = _verify(pg_dsn, schema, route)
    assert code == 1 and sorted(report["missing"]) == sorted(ids)
    # The operator makes the stream again; the relay sends the repaired events there.
    _repair_then_verify(
        pg_dsn,
        schema,
        route,
        ids,
        N,
        lambda: target.kinesis.create_stream(StreamName=target.name, ShardCount=2),
    )
    assert len(target.fetch()) == N


def _metric(text: str, name: str) -> dict[str, float]:
    return {
        line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name)
    }


def test_the_relay_verifies_on_its_schedule_a_loss_shows_in_metrics_and_one_line(
    pg_dsn: str, schema: str
) -> None:
    """`outbox relay --verify-every`: a Redis entry deleted after delivery shows as
    outbox_sink_missing_events 1 and one log line (not one a run); repaired, the gauge goes back
    to 0 and one line says so; the relay's verifications are recorded."""
    target = RedisTarget()
    port = free_port()
    relay = ModuleProcess(
        "outbox", "relay", "--dsn", pg_dsn, "--schema", schema, "--route", f"*={target.url()}",
        "--metrics-port", str(port), *FAST,
        "--verify-every", "0.5", "--verify-sample", "1", "--verify-window", "600",
    )  # fmt: skip
    try:
        _write(pg_dsn, schema, target.topic)
        wait_for(lambda: count(pg_dsn, schema, "delivered") == N, timeout=30, what="delivered")
        series = (
            f'outbox_sink_missing_events{{outbox="default",topic="{target.topic}",sink="{target.url()}"}}'
        )
        wait_for(lambda: _metric(http_get(port, "/metrics")[1], series) == {series: 0.0}, what="verified")
        client = redis.Redis(host="127.0.0.1", port=6379)
        client.xdel(target.topic, client.xrange(target.topic)[4][0])
        wait_for(
            lambda: _metric(http_get(port, "/metrics")[1], series) == {series: 1.0}, what="the loss seen"
        )
        time.sleep(2)  # several runs more: still one line
        checked = _metric(http_get(port, "/metrics")[1], "outbox_verify_checked_total")
        assert next(iter(checked.values())) >= 3 * N, checked
        code, report, _ = _verify(pg_dsn, schema, f"*={target.url()}", "--repair")
        assert code == 1 and len(report["missing"]) == 1
        wait_for(lambda: _metric(http_get(port, "/metrics")[1], series) == {series: 0.0}, what="mended")
        assert relay.stop() == 0
    finally:
        out = relay.output()
        relay.close()
        target.close()
    assert out.count("a sink lost delivered events: 1 of 12 read back are missing") == 1, out[-3000:]
    assert out.count("nothing read back is missing any more") == 1, out[-3000:]
    with psycopg.connect(pg_dsn) as conn:
        runs = conn.execute(
            f'SELECT count(*), max(missing) FROM "{schema}".verifications WHERE via = %s', ("relay",)
        )
        n, most = runs.fetchone() or (0, 0)
    assert n >= 3 and most == 1
