"""A/B of the relay's drain: two checkouts, interleaved, 200,000 realistic events each time.

Usage, from a checkout with its .venv (the other one is BEFORE, a `git worktree` of the commit):
    BEFORE=/tmp/before AFTER=$PWD .venv/bin/python benchmarks/runs/2026-12-06-stages/relay-ab.py
    ROUTE="*=amqp://guest:guest@127.0.0.1:5672/%2f?exchange=ab" BEFORE=... AFTER=... (RabbitMQ)

Each run fills the outbox (no statistics, autovacuum off), starts `outbox relay` of one checkout
against an embedded Tansu broker (or through the ``ROUTE`` given) and times it from its start
to an empty events table; the relay process's CPU is read from /proc when it is drained.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import uuid

import psycopg
from psycopg import sql

from outbox.harness.embedded import Broker
from outbox.write.writer import enqueue_many

DSN = os.environ.get("DSN", "postgresql://root@127.0.0.1:5432/test")
EVENTS, RUNS = 200_000, 8
CHECKOUTS = {"before": os.environ["BEFORE"], "after": os.environ["AFTER"]}
ROUTE = os.environ.get("ROUTE", "")  # a --route GLOB=URL; none: Kafka (an embedded Tansu broker)


def fill(schema: str) -> None:
    with psycopg.connect(DSN, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    subprocess.run([sys.executable, "-m", "outbox", "migrate", "--dsn", DSN, "--schema", schema], check=True)
    with psycopg.connect(DSN, autocommit=True) as admin:
        events = sql.Identifier(schema, "events")
        admin.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(events))
    line = {"sku": "A-1", "qty": 2, "price": "19.99"}
    headers = {"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01", "source": "shop"}
    with psycopg.connect(DSN) as conn:
        for start in range(0, EVENTS, 10_000):
            events = [
                {
                    "topic": f"orders.{i % 4}",
                    "key": f"customer-{i % 5000}",
                    "payload": {"order_id": str(uuid.uuid4()), "lines": [line] * 3, "note": "x" * 120},
                    "headers": headers,
                }
                for i in range(start, start + 10_000)
            ]
            enqueue_many(conn, events, schema=schema)
            conn.commit()


def pending(schema: str) -> int:
    with psycopg.connect(DSN) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "events"))
        ).fetchone()
    return int(row[0]) if row else 0


def drain(side: str, broker: Broker) -> tuple[float, float]:
    schema = f"ab_{side}"
    fill(schema)
    started = time.monotonic()
    relay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "outbox",
            "relay",
            "--dsn",
            DSN,
            "--schema",
            schema,
            *(["--route", ROUTE] if ROUTE else ["--kafka-bootstrap", broker.bootstrap]),
        ],
        cwd=CHECKOUTS[side],  # python -m: the checkout's own package first on the path
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = started + 120
    while pending(schema) > 0:
        if relay.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the {side} relay exited or stalled")
        time.sleep(0.05)
    wall = time.monotonic() - started
    with open(f"/proc/{relay.pid}/stat") as stat:
        fields = stat.read().split(")")[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    relay.terminate()
    relay.wait()
    return wall, cpu


def main() -> None:
    broker = Broker().start()
    results: dict[str, list[tuple[float, float]]] = {"before": [], "after": []}
    try:
        for run in range(RUNS):
            for side in ("before", "after") if run % 2 == 0 else ("after", "before"):
                wall, cpu = drain(side, broker)
                results[side].append((wall, cpu))
                print(side, run, "wall", round(wall, 2), "cpu", round(cpu, 2), flush=True)
    finally:
        broker.stop()
    for side, runs in results.items():
        walls, cpus = [w for w, _ in runs], [c for _, c in runs]
        print(side, "median wall", statistics.median(walls), "median cpu", statistics.median(cpus))


if __name__ == "__main__":
    main()
