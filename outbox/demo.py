"""``outbox demo``: the whole pipeline on one machine, with live progress.

Starts an embedded PostgreSQL and the embedded Kafka-protocol broker unless a
DSN / bootstrap address is given, migrates, then runs three actors side by side:
a sample app that writes orders and their events in real transactions (every
tenth one rolled back), the relay, and a Kafka consumer. It checks at the end
that every committed event was consumed and no rolled-back one was.
"""

from __future__ import annotations

import contextlib
import json
import random
import signal
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql

from outbox.embedded import Broker, embedded_postgres
from outbox.migrate import migrate
from outbox.relay import Relay, RelayConfig
from outbox.sinks.kafka import KafkaSink
from outbox.writer import enqueue

TOPIC = "demo.orders"
CUSTOMERS = 50
ROLLBACK_EVERY = 10  # every tenth business transaction fails and rolls back
PROGRESS_EVERY = 0.5  # seconds between progress updates
DRAIN_TIMEOUT = 30.0  # seconds to let the relay and consumer catch up at the end


class _Counters:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.committed: set[str] = set()
        self.rolled_back: set[str] = set()
        self.consumed: set[str] = set()
        self.consumed_total = 0


def _app(dsn: str, schema: str, rate: float, stop: threading.Event, c: _Counters) -> None:
    """The sample service: each order and its event in one transaction."""
    orders = sql.Identifier(schema, "demo_orders")
    interval = 1.0 / rate
    n = 0
    next_at = time.monotonic()
    with psycopg.connect(dsn) as conn:
        while not stop.is_set():
            n += 1
            customer = f"customer-{random.randrange(CUSTOMERS)}"
            order = {"order": n, "customer": customer, "amount": random.randint(5, 500)}
            fail = n % ROLLBACK_EVERY == 0
            try:
                with conn.transaction():
                    conn.execute(
                        sql.SQL("INSERT INTO {} (customer, amount) VALUES (%s, %s)").format(orders),
                        (customer, order["amount"]),
                    )
                    event_id = str(enqueue(conn, TOPIC, order, key=customer, schema=schema))
                    if fail:
                        raise _Rollback
            except _Rollback:
                with c.lock:
                    c.rolled_back.add(event_id)
            else:
                with c.lock:
                    c.committed.add(event_id)
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                stop.wait(delay)
            elif delay < -1.0:  # fell behind: do not burst to catch up
                next_at = time.monotonic()


class _Rollback(Exception):
    pass


def _consumer(bootstrap: str, stop: threading.Event, c: _Counters) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    partitions: list[int] = []
    while not stop.is_set() and not partitions:
        topic = admin.list_topics(TOPIC, timeout=2).topics.get(TOPIC)
        if topic is not None and topic.error is None:
            partitions = sorted(topic.partitions)
        else:
            stop.wait(0.2)
    if not partitions:
        return
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"outbox-demo-{uuid.uuid4().hex[:8]}",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(TOPIC, p, OFFSET_BEGINNING) for p in partitions])
    try:
        while not stop.is_set():
            msg = consumer.poll(0.2)
            if msg is None or msg.error():
                continue
            headers = dict(msg.headers() or [])
            event_id = headers.get("event-id")
            if not isinstance(event_id, bytes):
                continue  # not one of ours
            with c.lock:
                c.consumed.add(event_id.decode())
                c.consumed_total += 1
    finally:
        consumer.close()


@contextlib.contextmanager
def _infrastructure(dsn: str | None, bootstrap: str | None) -> Iterator[tuple[str, str]]:
    with contextlib.ExitStack() as stack:
        if dsn is None:
            print("starting embedded PostgreSQL ...", flush=True)
            dsn = stack.enter_context(embedded_postgres())
        if bootstrap is None:
            print("starting embedded Kafka-protocol broker (Tansu) ...", flush=True)
            bootstrap = stack.enter_context(Broker()).bootstrap
        yield dsn, bootstrap


def _progress(c: _Counters, relay: Relay, started: float, last: list[float]) -> str:
    now = time.monotonic()
    with c.lock:
        written, consumed = len(c.committed), len(c.consumed)
    delivered = relay.stats.delivered
    rate = (delivered - last[1]) / max(1e-6, now - last[0])
    last[:] = [now, delivered]
    return (
        f"[{now - started:6.1f}s] written {written:>8}  delivered {delivered:>8}  "
        f"consumed {consumed:>8}  rate {rate:>8.0f}/s  lag {written - delivered:>6}"
    )


def run_demo(
    *,
    dsn: str | None,
    bootstrap: str | None,
    schema: str,
    seconds: float,
    rate: float,
    kafka_config: dict[str, Any],
) -> int:
    if not rate > 0:
        raise ValueError(f"--rate: must be > 0, got {rate}")
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with _infrastructure(dsn, bootstrap) as (pg, kafka):
            with psycopg.connect(pg, autocommit=True) as conn:
                migrate(conn, schema)
                conn.execute(
                    sql.SQL(
                        "CREATE TABLE IF NOT EXISTS {} (id bigserial PRIMARY KEY, "
                        "customer text NOT NULL, amount integer NOT NULL, "
                        "created_at timestamptz NOT NULL DEFAULT now())"
                    ).format(sql.Identifier(schema, "demo_orders"))
                )
            return _run(pg, kafka, schema, seconds, rate, kafka_config, stop)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(
    dsn: str,
    bootstrap: str,
    schema: str,
    seconds: float,
    rate: float,
    kafka_config: dict[str, Any],
    stop: threading.Event,
) -> int:
    counters = _Counters()
    config = RelayConfig(dsn, schema=schema, poll_interval=0.5)
    relay = Relay(config, lambda: KafkaSink(bootstrap, kafka_config))
    app_stop, consumer_stop = threading.Event(), threading.Event()
    threads = [
        threading.Thread(target=relay.run, name="relay"),
        threading.Thread(target=_app, args=(dsn, schema, rate, app_stop, counters), name="app"),
        threading.Thread(target=_consumer, args=(bootstrap, consumer_stop, counters), name="consumer"),
    ]
    for t in threads:
        t.start()
    tty = sys.stdout.isatty()
    started = time.monotonic()
    last = [started, 0.0]
    print(
        f"demo: app writes ~{rate:.0f} orders/s to topic {TOPIC!r} "
        f"({'until Ctrl-C' if not seconds else f'for {seconds:.0f}s'})",
        flush=True,
    )
    try:
        next_print = started
        while not stop.is_set() and (not seconds or time.monotonic() - started < seconds):
            if any(not t.is_alive() for t in threads):
                break
            if time.monotonic() >= next_print:
                line = _progress(counters, relay, started, last)
                print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
                next_print += PROGRESS_EVERY if tty else 2.0
            stop.wait(0.1)
    except KeyboardInterrupt:
        pass
    # Stop writing, let the relay and the consumer catch up, then stop them.
    app_stop.set()
    threads[1].join()
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while time.monotonic() < deadline:
        with counters.lock:
            if counters.committed <= counters.consumed:
                break
        time.sleep(0.1)
    relay.stop()
    consumer_stop.set()
    for t in threads:
        t.join()
    line = _progress(counters, relay, started, last)
    print(("\r" + line) if tty else line, flush=True)
    with counters.lock:
        missing = counters.committed - counters.consumed
        leaked = counters.rolled_back & counters.consumed
        summary = {
            "committed": len(counters.committed),
            "rolled_back": len(counters.rolled_back),
            "consumed_unique": len(counters.consumed),
            "consumed_total": counters.consumed_total,
            "missing": len(missing),
            "rolled_back_but_consumed": len(leaked),
        }
    print("demo summary: " + json.dumps(summary), flush=True)
    if missing or leaked:
        print("demo: FAILED — see summary", file=sys.stderr)
        return 1
    print("demo: every committed event was consumed; no rolled-back event was.")
    return 0
