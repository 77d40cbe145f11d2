"""Key chains across sinks: one `outbox relay` drains N events alternating between a Kafka route
and a Redis Streams route, every key on both, and prints events/s (the relay's start included).

    python benchmarks/cross-sink/xsink.py N KEYS [TREE]     # RUNS=3 by default

TREE: a checkout to run the relay from (PYTHONPATH), to compare two versions in the same minutes.
Needs the machine's PostgreSQL (dbname test) and Redis; a Tansu broker is started for the run.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psycopg
import redis
from psycopg import sql

import outbox
from outbox.embedded import Broker
from outbox.migrate import migrate

DSN = "host=127.0.0.1 dbname=test user=root"
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def write(schema: str, stream: str, n: int, keys: int) -> None:
    with psycopg.connect(DSN) as conn:
        rows = []
        for i in range(n):
            rows.append(
                {
                    "topic": "k.orders" if i % 2 == 0 else stream,
                    "payload": {"order": i, "total": "9.99", "items": ["a", "b"]},
                    "key": f"key-{i % keys}",
                    "headers": {"traceparent": TRACEPARENT},
                }
            )
            if len(rows) == 1000:
                outbox.enqueue_many(conn, rows, schema=schema)
                rows = []
        if rows:
            outbox.enqueue_many(conn, rows, schema=schema)
        conn.commit()


def drain(schema: str, stream: str, bootstrap: str, tree: str) -> float:
    env = {**os.environ, "PYTHONPATH": tree}
    routes = ["--route", f"k.*=kafka://{bootstrap}", "--route", "*=redis://127.0.0.1:6379/0"]
    t0 = time.monotonic()
    relay = subprocess.Popen(
        [sys.executable, "-m", "outbox", "relay", "--dsn", DSN, "--schema", schema, *routes,
         "--log-level", "warning"],
        env=env, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        pending = sql.SQL("SELECT count(*) FROM {}.events").format(sql.Identifier(schema))
        with psycopg.connect(DSN, autocommit=True) as conn:
            while conn.execute(pending).fetchone() != (0,):
                time.sleep(0.05)
                if time.monotonic() - t0 > 300:
                    raise SystemExit("not drained in 300 s")
        return time.monotonic() - t0
    finally:
        relay.terminate()
        relay.wait(30)


def main() -> None:
    n, keys = int(sys.argv[1]), int(sys.argv[2])
    tree = sys.argv[3] if len(sys.argv) > 3 else ""
    rates = []
    with Broker() as broker:
        for run in range(int(os.environ.get("RUNS", "3"))):
            schema, stream = f"xs_{uuid.uuid4().hex[:8]}", f"s-{uuid.uuid4().hex[:8]}"
            with psycopg.connect(DSN, autocommit=True) as conn:
                migrate(conn, schema)
            write(schema, stream, n, keys)
            took = drain(schema, stream, broker.bootstrap, tree)
            rates.append(n / took)
            with psycopg.connect(DSN, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
            redis.Redis().delete(stream)
            print(f"run {run}: {n} events in {took:.2f} s = {n / took:,.0f}/s", flush=True)
    rates.sort()
    print(f"median {rates[len(rates) // 2]:,.0f}/s")


if __name__ == "__main__":
    main()
