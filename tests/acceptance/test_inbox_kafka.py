"""Effectively once, end to end through Kafka: the relay killed with a batch produced but not
archived (so the broker holds duplicates), the consumer killed inside a handler; after both
restart, every committed event's effect exists exactly once, in per-key order. And
``consume_kafka``'s contract in process: a handler that raises is rolled back and tried
again; two consumer names see every event independently; a signal stops it cleanly."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql

import outbox
from outbox.inbox import ConsumeStats, Delivery, consume_kafka
from tests.helpers import Message, ModuleProcess, RelayProcess, count, read_topic, wait_for
from tests.inbox_consumer import GROUP_SETTINGS

ROOT = Path(__file__).resolve().parents[2]
KEYS = 20


def _enqueue(dsn: str, schema: str, topic: str, n: int) -> None:
    with psycopg.connect(dsn) as conn:
        outbox.enqueue_many(
            conn,
            [
                {"topic": topic, "payload": {"k": f"k{i % KEYS}", "seq": i}, "key": f"k{i % KEYS}"}
                for i in range(n)
            ],
            schema=schema,
        )
        conn.commit()
        conn.execute(
            sql.SQL(
                "CREATE TABLE {}.effects (n bigserial PRIMARY KEY, event_id text, k text, seq int)"
            ).format(sql.Identifier(schema))
        )
        conn.commit()


def _end_offsets(messages: list[Message]) -> int:
    """What a consumer group that read ``messages`` (a whole topic) has committed: each
    partition's last offset + 1, summed. (Tansu's reported high watermarks lag behind.)"""
    last: dict[int, int] = {}
    for m in messages:
        last[m.partition] = max(last.get(m.partition, -1), m.offset)
    return sum(o + 1 for o in last.values())


def _committed(bootstrap: str, topic: str, group: str) -> int:
    """The group's committed offsets summed over the topic's partitions."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    parts = admin.list_topics(topic, timeout=10).topics[topic].partitions
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group})
    try:
        done = c.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return sum(max(tp.offset, 0) for tp in done)
    finally:
        c.close()


def consumer_process(*args: str) -> ModuleProcess:
    """tests.inbox_consumer (consume_kafka as an app writes it) as a real process."""
    return ModuleProcess("tests.inbox_consumer", *args)


def _effects(dsn: str, schema: str) -> list[tuple[str, str, int]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT event_id, k, seq FROM {}.effects ORDER BY n").format(sql.Identifier(schema))
        ).fetchall()
    return [(str(e), str(k), int(s)) for e, k, s in rows]


def _assert_once_in_order(dsn: str, schema: str, n: int) -> None:
    effects = _effects(dsn, schema)
    ids = [e for e, _, _ in effects]
    assert len(ids) == len(set(ids)) == n, f"{len(ids)} effects of {len(set(ids))} events, expected {n} once"
    last: dict[str, int] = {}
    for _, k, seq in effects:
        assert seq > last.get(k, -1), f"key {k}: effect of seq {seq} after {last.get(k)}"
        last[k] = seq


@pytest.mark.slow
def test_relay_and_consumer_killed_every_effect_happens_once(
    pg_dsn: str, schema: str, kafka: str, topic: str, tmp_path: Path
) -> None:
    n = 3000
    _enqueue(pg_dsn, schema, topic, n)
    relay_opts = ("--batch-size", "500")

    # 1. The relay produces a batch, then its archive waits on a lock: killed there, the
    #    batch is in the broker but still pending, and the next relay sends it again.
    delivered = sql.Identifier(schema, "delivered").as_string()
    with psycopg.connect(pg_dsn) as blocker:
        blocker.execute(
            sql.SQL("LOCK TABLE {} IN EXCLUSIVE MODE").format(sql.Identifier(schema, "delivered"))
        )
        with RelayProcess(pg_dsn, schema, kafka, *relay_opts) as first:
            wait_for(
                lambda: (
                    count(
                        pg_dsn,
                        "pg_catalog",
                        "pg_locks",
                        f"NOT granted AND relation = '{delivered}'::regclass",
                    )
                    > 0
                ),
                timeout=60,
                what="the relay's archive waiting on the lock",
            )
            first.proc.send_signal(signal.SIGKILL)
            first.proc.wait(10)
        blocker.rollback()
    produced_before_restart = len(read_topic(kafka, topic, 1))
    assert produced_before_restart > 0
    assert count(pg_dsn, schema, "delivered") == 0, "nothing was archived: all of it will be sent again"

    # 2. A consumer killed inside its 50th handler (of at least 100 in the broker: the relay's
    #    first claim, its slow start), its transaction open.
    marker = tmp_path / "stalled"
    group = f"g-{topic}"
    args = (pg_dsn, schema, kafka, topic, group)
    stalled = consumer_process(*args, "50", str(marker))
    try:
        wait_for(marker.exists, timeout=90, what="the consumer inside its 50th handler")
        stalled.proc.send_signal(signal.SIGKILL)
        stalled.proc.wait(10)
    finally:
        stalled.close()
    assert len(_effects(pg_dsn, schema)) == 49, "the stalled handler's effect did not commit"

    # 3. The relay again (duplicates of step 1 follow), and the consumer again.
    with RelayProcess(pg_dsn, schema, kafka, *relay_opts) as second:
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=120, what="drain")
        assert second.stop() == 0, second.output()
    messages = read_topic(kafka, topic, n + produced_before_restart)
    assert len(messages) == n + produced_before_restart, "the broker holds the duplicates"
    end = _end_offsets(messages)
    consumer = consumer_process(*args)
    try:
        wait_for(lambda: _committed(kafka, topic, group) >= end, timeout=120, what="every offset consumed")
        consumer.proc.send_signal(signal.SIGTERM)
        assert consumer.proc.wait(30) == 0, consumer.output()
        out = consumer.output()
    finally:
        consumer.close()
    assert "duplicates=0" not in out, out
    _assert_once_in_order(pg_dsn, schema, n)
    assert count(pg_dsn, schema, "inbox") == n


@contextmanager
def _consuming(
    kafka: str,
    topic: str,
    group: str,
    handler: Callable[[psycopg.Connection[Any], Delivery], None],
    **kw: Any,
) -> Iterator[list[ConsumeStats]]:
    """consume_kafka in a thread for the block; its stats in the yielded list after it."""
    stop = threading.Event()
    out: list[ConsumeStats] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            out.append(
                consume_kafka(
                    {"bootstrap.servers": kafka, "group.id": group, **GROUP_SETTINGS},
                    [topic],
                    handler,
                    stop=stop,
                    **kw,
                )
            )
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        yield out
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive(), "consume_kafka did not stop"
    if errors:
        raise errors[0]


def _relay_all(pg_dsn: str, schema: str, kafka: str, n: int) -> None:
    with RelayProcess(pg_dsn, schema, kafka) as relay:
        wait_for(lambda: count(pg_dsn, schema, "delivered") == n, timeout=60, what="delivered")
        assert relay.stop() == 0


def test_a_handler_that_raises_is_rolled_back_and_retried_in_order(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    n = 200
    _enqueue(pg_dsn, schema, topic, n)
    _relay_all(pg_dsn, schema, kafka, n)
    insert = sql.SQL("INSERT INTO {}.effects (event_id, k, seq) VALUES (%s, %s, %s)").format(
        sql.Identifier(schema)
    )
    failed: list[int] = []

    def handler(conn: psycopg.Connection[Any], d: Delivery) -> None:
        body = json.loads(d.value)
        conn.execute(insert, (d.event_id, body["k"], body["seq"]))  # the effect, then the failure
        if body["seq"] in (7, 8) and body["seq"] not in failed:
            failed.append(body["seq"])
            raise RuntimeError("payment service unavailable")

    with _consuming(kafka, topic, f"g-{topic}", handler, dsn=pg_dsn, schema=schema, retry_base=0.05) as stats:
        wait_for(lambda: count(pg_dsn, schema, "effects") >= n, timeout=60, what="every effect")
        time.sleep(0.5)  # a second effect of a retried event would show by now
    assert failed == [7, 8] or failed == [8, 7]
    assert (stats[0].handled, stats[0].failures, stats[0].duplicates) == (n, 2, 0)
    _assert_once_in_order(pg_dsn, schema, n)


def test_two_consumer_names_see_every_event_independently(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    n = 100
    _enqueue(pg_dsn, schema, topic, n)
    _relay_all(pg_dsn, schema, kafka, n)
    seen: dict[str, list[str]] = {"billing": [], "shipping": []}

    def handler_of(name: str) -> Callable[[psycopg.Connection[Any], Delivery], None]:
        return lambda conn, d: seen[name].append(d.event_id)

    with (
        _consuming(
            kafka, topic, "billing-" + topic, handler_of("billing"), dsn=pg_dsn, schema=schema, name="billing"
        ) as a,
        _consuming(
            kafka,
            topic,
            "shipping-" + topic,
            handler_of("shipping"),
            dsn=pg_dsn,
            schema=schema,
            name="shipping",
        ) as b,
    ):
        wait_for(lambda: min(len(v) for v in seen.values()) >= n, timeout=60, what="both consumers")
    assert sorted(seen["billing"]) == sorted(seen["shipping"])
    assert len(set(seen["billing"])) == n
    assert a[0].handled == b[0].handled == n
    assert count(pg_dsn, schema, "inbox") == 2 * n
    # The same group again, from the start: everything is a duplicate, nothing runs twice.
    with _consuming(
        kafka, topic, "again-" + topic, handler_of("billing"), dsn=pg_dsn, schema=schema, name="billing"
    ) as c:
        end = _end_offsets(read_topic(kafka, topic, n))
        wait_for(lambda: _committed(kafka, topic, "again-" + topic) >= end, timeout=60, what="a second pass")
    assert (c[0].handled, c[0].duplicates) == (0, n)
    assert len(seen["billing"]) == n
