"""Logs stay readable during an outage: one line when a problem starts, a summary a minute,
one line when it ends — for a 30 s broker outage with a 20 s database outage inside it.

The broker is a Tansu process the test stops and starts (back empty); the database is taken
away by a loopback proxy that resets every connection (``outbox_bench.harness.proxy``). A writer
keeps committing straight to PostgreSQL meanwhile, so the relay always has work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
from outbox_bench.harness.proxy import Proxy
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox.harness.embedded import Broker, free_port
from tests.helpers import count, wait_for

BROKER_OUTAGE = 30.0  # seconds
DATABASE_OUTAGE = 20.0  # seconds, inside the broker outage
MAX_LINES = 30  # every condition's start and end, a few one-off events; hundreds without conditions


def run_outage(python: str, pg_dsn: str, schema: str, topic: str, log: Path) -> dict[str, Any]:
    """Run ``python -m outbox relay`` through both outages; return its log lines and timeline.

    Written so that another installation's relay (``python``) can be measured the same way.
    """
    parts = conninfo_to_dict(pg_dsn)
    broker = Broker().start()
    proxy = Proxy(str(parts.get("host", "127.0.0.1")), int(parts.get("port", 5432))).start()
    relay_dsn = make_conninfo(**{**parts, "host": "127.0.0.1", "port": str(proxy.port)})
    port = free_port()
    stop_writing = threading.Event()

    def write() -> None:
        with psycopg.connect(pg_dsn) as conn:
            i = 0
            while not stop_writing.wait(0.05):
                outbox.enqueue(conn, topic, {"n": i}, key=f"k{i % 20}", schema=schema)
                conn.commit()
                i += 1

    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    with open(log, "wb") as out:
        relay = subprocess.Popen(
            [
                python, "-m", "outbox", "relay", "--dsn", relay_dsn, "--schema", schema,
                "--kafka-bootstrap", broker.bootstrap, "--metrics-port", str(port),
                "--lease", "10", "--delivery-timeout", "5", "--retry-base", "0.5", "--retry-cap", "2",
                "--max-attempts", "1000", "--poll-interval", "0.2", "--log-format", "json",
            ],
            stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, cwd=log.parent,
        )  # fmt: skip
    writer = threading.Thread(target=write, daemon=True)
    timeline: dict[str, float] = {}
    try:
        writer.start()
        wait_for(lambda: count(pg_dsn, schema, "delivered") > 20, timeout=30, what="delivering")
        start_line = len(log.read_text().splitlines())
        timeline["broker down"] = time.monotonic()
        broker.stop()
        time.sleep(5.0)  # the fault's duration, not a wait for a condition
        proxy.refuse()
        timeline["database down"] = time.monotonic()
        time.sleep(DATABASE_OUTAGE)
        proxy.heal()
        timeline["database back"] = time.monotonic()
        time.sleep(max(0.0, BROKER_OUTAGE - (time.monotonic() - timeline["broker down"])))
        broker.start()
        timeline["broker back"] = time.monotonic()
        stop_writing.set()
        writer.join(10)
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=90, interval=0.2, what="drained")
        timeline["drained"] = time.monotonic()
        lines = log.read_text().splitlines()[start_line:]
    finally:
        stop_writing.set()
        relay.terminate()
        relay.wait(30)
        proxy.stop()
        broker.stop()
    events: dict[str, int] = {}
    for line in lines:
        try:
            event = json.loads(line).get("event")
        except ValueError:
            continue
        if event:
            events[event] = events.get(event, 0) + 1
    base = timeline["broker down"]
    return {
        "lines": lines,
        "events": events,
        "timeline": {k: round(v - base, 1) for k, v in timeline.items()},
    }


def test_an_outage_of_broker_and_database_is_a_few_lines(
    pg_dsn: str, schema: str, topic: str, tmp_path: Path
) -> None:
    result = run_outage(sys.executable, pg_dsn, schema, topic, tmp_path / "relay.log")
    lines, events = result["lines"], result["events"]
    detail = "\n".join(lines[-60:])
    assert len(lines) <= MAX_LINES, f"{len(lines)} lines for a 30 s outage ({result['timeline']}):\n{detail}"
    # Each outage is told: when it started, and when it ended.
    for name in ("kafka", "database"):
        assert events.get(f"{name}.started", 0) >= 1 and events.get(f"{name}.ended", 0) >= 1, (name, events)
    assert all(n <= 2 for e, n in events.items() if e.endswith(".started")), events
    assert count(pg_dsn, schema, "dead_letters") == 0
