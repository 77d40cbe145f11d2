"""``outbox demo``: the whole pipeline on one machine, with live progress.

Starts an embedded PostgreSQL and the embedded Kafka-protocol broker unless a
DSN / bootstrap address is given (``outbox.harness.infra``), migrates, then runs
three actors side by side: a sample app that writes orders and their events in
real transactions, every tenth one rolled back (``outbox.harness.load``), the
relay, and a Kafka consumer (``outbox.harness.tap``). It checks at the end that
every committed event was consumed and no rolled-back one was.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from typing import Any

import psycopg

from outbox.capture import state as capture_state
from outbox.capture import switch
from outbox.errors import ConfigError
from outbox.harness.infra import infrastructure
from outbox.harness.load import Load, prepare
from outbox.harness.tap import Tap
from outbox.relay.config import RelayConfig
from outbox.relay.relay import Relay
from outbox.sinks.kafka import KafkaSink
from outbox.store.migrate import migrate

TOPIC = "demo.orders"
CUSTOMERS = 50  # keys
ROLLBACK_EVERY = 10  # every tenth business transaction fails and rolls back
PROGRESS_EVERY = 0.5  # seconds between progress updates on a terminal (2 s otherwise)
DRAIN_TIMEOUT = 30.0  # seconds to let the relay and consumer catch up at the end


def run_demo(
    *,
    dsn: str | None,
    bootstrap: str | None,
    schema: str,
    seconds: float,
    rate: float,
    kafka_config: dict[str, Any],
    capture: str = "table",
) -> int:
    if not rate > 0:
        raise ConfigError(f"--rate: must be > 0, got {rate}")
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        with infrastructure(dsn, bootstrap) as infra:
            with psycopg.connect(infra.dsn, autocommit=True) as conn:
                migrate(conn, schema)
                if capture != "table" or capture_state(conn, schema).mode != "table":
                    print(switch(conn, schema, capture), file=sys.stderr, flush=True)
            prepare(infra.dsn, schema)
            return _run(infra.dsn, infra.bootstrap, schema, seconds, rate, kafka_config, stop)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _progress(load: Load, tap: Tap, relay: Relay, started: float, last: list[float]) -> str:
    now = time.monotonic()
    written, consumed, delivered = load.count, tap.count(), relay.stats.delivered
    rate = (delivered - last[1]) / max(1e-6, now - last[0])
    last[:] = [now, delivered]
    return (
        f"[{now - started:6.1f}s] written {written:>8}  delivered {delivered:>8}  "
        f"consumed {consumed:>8}  rate {rate:>8.0f}/s  lag {written - delivered:>6}"
    )


def _run(
    dsn: str,
    bootstrap: str,
    schema: str,
    seconds: float,
    rate: float,
    kafka_config: dict[str, Any],
    stop: threading.Event,
) -> int:
    relay = Relay(
        RelayConfig(dsn, schema=schema, poll_interval=0.5), lambda: KafkaSink(bootstrap, kafka_config)
    )
    load = Load(dsn, schema, TOPIC, rate=rate, keys=CUSTOMERS, rollback_every=ROLLBACK_EVERY)
    tap = Tap(bootstrap, TOPIC)
    relay_thread = threading.Thread(target=relay.run, name="relay")
    relay_thread.start()
    load.start()
    tap.start()
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
            if not relay_thread.is_alive() or not load.alive():
                break
            if time.monotonic() >= next_print:
                line = _progress(load, tap, relay, started, last)
                print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True)
                next_print += PROGRESS_EVERY if tty else 2.0
            stop.wait(0.1)
    except KeyboardInterrupt:
        pass
    # Stop writing, let the relay and the consumer catch up, then stop them.
    load.stop()
    committed = {w.event_id for w in load.committed}
    deadline = time.monotonic() + DRAIN_TIMEOUT
    while time.monotonic() < deadline:
        with tap.lock:
            if committed <= tap.first_seen.keys():
                break
        time.sleep(0.1)
    relay.stop()
    tap.stop_event.set()
    relay_thread.join()
    tap.join()
    line = _progress(load, tap, relay, started, last)
    print(("\r" + line) if tty else line, flush=True)
    with tap.lock:
        consumed = set(tap.first_seen)
        consumed_total = len(tap.seen)
    rolled_back = {w.event_id for w in load.rolled_back}
    missing = committed - consumed
    leaked = rolled_back & consumed
    summary = {
        "committed": len(committed),
        "rolled_back": len(rolled_back),
        "consumed_unique": len(consumed),
        "consumed_total": consumed_total,
        "missing": len(missing),
        "rolled_back_but_consumed": len(leaked),
    }
    print("demo summary: " + json.dumps(summary), flush=True)
    if missing or leaked:
        print("demo: FAILED — see summary", file=sys.stderr)
        return 1
    print("demo: every committed event was consumed; no rolled-back event was.")
    return 0
