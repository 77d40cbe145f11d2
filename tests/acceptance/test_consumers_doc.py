"""Every consumer recipe in docs/consumers.md, run as written against the real server: the
relay delivers events, then sends some of them again (archived rows put back, as after a
crash between the broker's ack and the archive), and the recipe's effect must exist exactly
once per event while it saw every copy."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path
from typing import Any

import aiormq
import nats
import psycopg
import pytest
import redis
from outbox_bench.harness.sinktaps import Request
from psycopg import sql

import outbox
from outbox.relay.config import RelayConfig
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from outbox.sinks.signing import parse_secrets
from tests.aws_servers import EventBridgeTarget, KinesisTarget, Moto, SnsTarget, SqsTarget
from tests.helpers import count, running_relay, wait_for
from tests.sink_servers import RABBIT, REDIS, HttpTarget, NatsTarget, RabbitTarget, RedisTarget, Target

DOC = Path(__file__).resolve().parents[2] / "docs" / "consumers.md"
RECIPE = re.compile(r"<!-- recipe: (\w+) -->\n```python\n(.*?)```", re.DOTALL)
RECIPES = dict(RECIPE.findall(DOC.read_text()))
SECRET = "whsec_" + "c2VjcmV0LWZvci10aGUtcmVjaXBlLXRlc3Q="
N = 60  # events
AGAIN = 25  # of them sent a second time


def _recipe(name: str, schema: str) -> dict[str, Any]:
    """The recipe's functions, its SCHEMA (from OUTBOX_SCHEMA) set to the test's."""
    namespace: dict[str, Any] = {}
    exec(compile(RECIPES[name], f"docs/consumers.md#{name}", "exec"), namespace)
    namespace["SCHEMA"] = schema
    return namespace


def test_the_doc_has_a_recipe_per_sink_beyond_kafka() -> None:
    assert sorted(RECIPES) == [
        "eventbridge",
        "kinesis",
        "nats",
        "rabbitmq",
        "redis",
        "sns",
        "sqs",
        "webhooks",
    ]


def _effect_sql(schema: str) -> sql.Composed:
    return sql.SQL("INSERT INTO {}.effects (k, seq) VALUES (%s, %s)").format(sql.Identifier(schema))


def _deliver_twice(pg_dsn: str, schema: str, target: Target, secrets: list[bytes] | None = None) -> None:
    """N events to the target, then AGAIN of them once more with the same event ids."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(sql.SQL("CREATE TABLE {}.effects (k text, seq int)").format(sql.Identifier(schema)))
        outbox.enqueue_many(
            conn,
            [
                {"topic": target.topic, "payload": {"k": f"k{i % 5}", "seq": i}, "key": f"k{i % 5}"}
                for i in range(N)
            ],
            schema=schema,
        )
        conn.commit()
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1, delivery_timeout=5.0)
    factory = routed(
        parse_routes([f"*={target.url()}"], None), config.delivery_timeout, webhook_secrets=secrets
    )
    with running_relay(config, factory):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == N, timeout=30, what="first delivery")
        if isinstance(target, NatsTarget):
            time.sleep(1.2)  # past the stream's duplicate window (set to 1 s below)
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {s}.events (event_id, topic, key, payload, headers) "
                    "SELECT event_id, topic, key, payload, headers FROM {s}.delivered ORDER BY id LIMIT %s"
                ).format(s=sql.Identifier(schema)),
                (AGAIN,),
            )
            conn.commit()
        wait_for(lambda: count(pg_dsn, schema, "delivered") == N + AGAIN, timeout=30, what="second delivery")


def _assert_once(pg_dsn: str, schema: str, calls: int) -> None:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT coalesce(sum(attempts - 1), 0) FROM {}.delivered").format(sql.Identifier(schema))
        ).fetchone()
    retries = int(row[0]) if row else 0
    # Every copy, and at most one more per attempt the relay retried: a timed-out send may have
    # arrived (moto, loaded by the suite, once went 5 s without answering 5 sends it had taken).
    assert N + AGAIN <= calls <= N + AGAIN + retries, f"the recipe saw {calls} copies, {retries} retries"
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT count(*), count(DISTINCT seq) FROM {}.effects").format(sql.Identifier(schema))
        ).fetchone()
    assert rows == (N, N), "one effect per event"
    assert count(pg_dsn, schema, "inbox") == N


async def _every_copy(calls: list[int]) -> None:
    """Until the recipe has seen every copy (N + AGAIN deliveries), at most 30 s."""
    deadline = time.monotonic() + 30
    while len(calls) < N + AGAIN and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def _async_handle(schema: str) -> Any:
    async def handle(db: psycopg.AsyncConnection[Any], body: bytes) -> None:
        event = json.loads(body)
        await db.execute(_effect_sql(schema), (event["k"], event["seq"]))

    return handle


def test_rabbitmq_recipe(pg_dsn: str, schema: str) -> None:
    on_message = _recipe("rabbitmq", schema)["on_message"]
    target = RabbitTarget()
    try:
        _deliver_twice(pg_dsn, schema, target)
        handle = _async_handle(schema)
        calls: list[int] = []

        async def consume() -> None:
            db = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
            amqp = await aiormq.connect(f"amqp://guest:guest@{RABBIT[0]}:{RABBIT[1]}/")
            channel = await amqp.channel()
            await channel.basic_qos(prefetch_count=100)
            lock = asyncio.Lock()

            async def callback(message: Any) -> None:
                await on_message(db, lock, channel, message, handle)
                calls.append(1)

            await channel.basic_consume(target.queue, callback)  # type: ignore[attr-defined]
            await _every_copy(calls)
            await amqp.close()
            await db.close()

        asyncio.run(consume())
        _assert_once(pg_dsn, schema, len(calls))
    finally:
        target.close()


def test_nats_recipe(pg_dsn: str, schema: str) -> None:
    on_message = _recipe("nats", schema)["on_message"]
    target = NatsTarget()

    async def short_window() -> None:
        nc = await nats.connect(target.url())
        js = nc.jetstream()
        await js.update_stream(name=target.stream, subjects=target.subjects, duplicate_window=1.0)
        await nc.close()

    try:
        asyncio.run(short_window())
        _deliver_twice(pg_dsn, schema, target)
        handle = _async_handle(schema)
        calls: list[int] = []

        async def consume() -> None:
            db = await psycopg.AsyncConnection.connect(pg_dsn, autocommit=True)
            nc = await nats.connect(target.url())
            js = nc.jetstream()

            async def callback(msg: Any) -> None:
                await on_message(db, msg, handle)
                calls.append(1)

            await js.subscribe(target.topic, durable="billing", manual_ack=True, cb=callback)
            await _every_copy(calls)
            await nc.close()
            await db.close()

        asyncio.run(consume())
        _assert_once(pg_dsn, schema, len(calls))
    finally:
        target.close()


def test_redis_recipe(pg_dsn: str, schema: str) -> None:
    on_entry = _recipe("redis", schema)["on_entry"]
    target = RedisTarget()
    try:
        _deliver_twice(pg_dsn, schema, target)
        client = redis.Redis(host=REDIS[0], port=REDIS[1])
        client.xgroup_create(target.topic, "billing", id="0")

        def handle(db: psycopg.Connection[Any], payload: bytes) -> None:
            event = json.loads(payload)
            db.execute(_effect_sql(schema), (event["k"], event["seq"]))

        calls = 0
        with psycopg.connect(pg_dsn, autocommit=True) as db:
            deadline = time.monotonic() + 30
            while calls < N + AGAIN and time.monotonic() < deadline:
                reply = client.xreadgroup("billing", "c1", {target.topic: ">"}, count=100, block=200)
                for stream, entries in reply or []:
                    for entry_id, fields in entries:
                        on_entry(db, client, stream, "billing", entry_id, fields, handle)
                        calls += 1
        assert client.xpending(target.topic, "billing")["pending"] == 0, "every entry acked"
        client.close()
        _assert_once(pg_dsn, schema, calls)
    finally:
        target.close()


def test_webhooks_recipe(pg_dsn: str, schema: str) -> None:
    on_request = _recipe("webhooks", schema)["on_request"]
    target = HttpTarget()
    calls: list[int] = []

    def handle(db: psycopg.Connection[Any], body: bytes) -> None:
        event = json.loads(body)
        db.execute(_effect_sql(schema), (event["k"], event["seq"]))

    def decide(request: Request) -> tuple[int, dict[str, str], bytes]:
        with psycopg.connect(pg_dsn, autocommit=True) as db:  # a connection per request
            status = on_request(db, SECRET, request.headers, request.body, handle)
        calls.append(status)
        return status, {}, b""

    target.decide = decide
    try:
        _deliver_twice(pg_dsn, schema, target, parse_secrets(SECRET))
        assert set(calls) == {204}
        _assert_once(pg_dsn, schema, len(calls))
        forged = Request("/x", {"webhook-id": "e1", "webhook-timestamp": str(int(time.time())),
                                "webhook-signature": "v1,AAAA"}, b"{}")  # fmt: skip
        with psycopg.connect(pg_dsn, autocommit=True) as db:
            assert on_request(db, SECRET, forged.headers, forged.body, handle) == 401
    finally:
        target.close()


# -- AWS, in moto (tests/aws_servers.py): the relay's route in-process, the recipe reads with boto3


def _sync_handle(schema: str) -> Any:
    def handle(db: psycopg.Connection[Any], body: str | bytes | dict[str, Any]) -> None:
        event = body if isinstance(body, dict) else json.loads(body)
        db.execute(_effect_sql(schema), (event["k"], event["seq"]))

    return handle


def _consume_queue(pg_dsn: str, target: SqsTarget | SnsTarget | EventBridgeTarget, on_message: Any,
                   handle: Any) -> int:  # fmt: skip
    """Read the target's queue as the recipes say, each message through ``on_message``, until
    every copy has come (N + AGAIN) or 30 s; the number of messages handled."""
    sqs, calls = target.sqs, 0
    with psycopg.connect(pg_dsn, autocommit=True) as db:
        deadline = time.monotonic() + 30
        while calls < N + AGAIN and time.monotonic() < deadline:
            page = sqs.receive_message(
                QueueUrl=target.queue_url, MaxNumberOfMessages=10, WaitTimeSeconds=1,
                MessageAttributeNames=["All"],
            )  # fmt: skip
            for message in page.get("Messages", []):
                on_message(db, sqs, target.queue_url, message, handle)
                calls += 1
    left = sqs.get_queue_attributes(
        QueueUrl=target.queue_url,
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"],
    )["Attributes"]
    assert left == {"ApproximateNumberOfMessages": "0", "ApproximateNumberOfMessagesNotVisible": "0"}, left
    return calls


def test_sqs_recipe(pg_dsn: str, schema: str, moto_server: Moto, aws_env: dict[str, str]) -> None:
    on_message = _recipe("sqs", schema)["on_message"]
    target = SqsTarget(moto_server)
    _deliver_twice(pg_dsn, schema, target)
    _assert_once(pg_dsn, schema, _consume_queue(pg_dsn, target, on_message, _sync_handle(schema)))


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "enveloped"])
def test_sns_recipe(pg_dsn: str, schema: str, moto_server: Moto, aws_env: dict[str, str], raw: bool) -> None:
    on_message = _recipe("sns", schema)["on_message"]
    target = SnsTarget(moto_server)
    if not raw:
        sns = moto_server.client("sns")
        for sub in sns.list_subscriptions()["Subscriptions"]:
            if sub["TopicArn"].endswith(":" + target.name):
                sns.set_subscription_attributes(
                    SubscriptionArn=sub["SubscriptionArn"], AttributeName="RawMessageDelivery",
                    AttributeValue="false",
                )  # fmt: skip
    _deliver_twice(pg_dsn, schema, target)
    if not raw:  # what the queue holds is SNS's envelope, the event id among its attributes
        first = target.sqs.receive_message(QueueUrl=target.queue_url, VisibilityTimeout=0)["Messages"][0]
        assert json.loads(first["Body"])["Type"] == "Notification"
    _assert_once(pg_dsn, schema, _consume_queue(pg_dsn, target, on_message, _sync_handle(schema)))


def test_eventbridge_recipe(pg_dsn: str, schema: str, moto_server: Moto, aws_env: dict[str, str]) -> None:
    on_message = _recipe("eventbridge", schema)["on_message"]
    target = EventBridgeTarget(moto_server)
    _deliver_twice(pg_dsn, schema, target)
    _assert_once(pg_dsn, schema, _consume_queue(pg_dsn, target, on_message, _sync_handle(schema)))


def test_kinesis_recipe(pg_dsn: str, schema: str, moto_server: Moto, aws_env: dict[str, str]) -> None:
    consume_shard = _recipe("kinesis", schema)["consume_shard"]
    target = KinesisTarget(moto_server)  # two shards, ?envelope=json
    _deliver_twice(pg_dsn, schema, target)
    kinesis, handle = target.kinesis, _sync_handle(schema)
    calls: list[int] = []

    def counted(db: psycopg.Connection[Any], payload: dict[str, Any]) -> None:
        handle(db, payload)
        calls.append(payload["seq"])

    shards = [s["ShardId"] for s in kinesis.list_shards(StreamName=target.name)["Shards"]]
    with psycopg.connect(pg_dsn, autocommit=True) as db:
        ends = {shard: consume_shard(db, kinesis, target.name, shard, counted) for shard in shards}
        assert all(ends.values()), "every shard got records"
        # A restart from the start replays every record; the inbox skips them all. One from the
        # returned position finds nothing new.
        for shard in shards:
            assert consume_shard(db, kinesis, target.name, shard, counted) == ends[shard]
            assert consume_shard(db, kinesis, target.name, shard, counted, after=ends[shard]) == ends[shard]
    assert len(calls) == N, "one effect per event, duplicates and replays skipped"
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT count(*), count(DISTINCT seq) FROM {}.effects").format(sql.Identifier(schema))
        ).fetchone()
    assert rows == (N, N)
    # Per key, the effects follow the events' order: one key's records are in one shard.
    with psycopg.connect(pg_dsn) as conn:
        seqs = [r[0] for r in conn.execute(
            sql.SQL("SELECT seq FROM {}.effects WHERE k = 'k0' ORDER BY ctid").format(sql.Identifier(schema))
        )]  # fmt: skip
    assert seqs == sorted(seqs)
