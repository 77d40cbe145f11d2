"""A writer for the upgrade tests, run by either release (``python -m tests.upgrade_writer DSN
SCHEMA TOPIC PREFIX STOPFILE``): one event per key per transaction, payload {"k", "seq"}, seq
counting up per key, until STOPFILE exists; then prints how many rounds it wrote and the
slowest commit in ms (what a migration's lock made it wait)."""

from __future__ import annotations

import os
import sys
import time

import psycopg

import outbox

KEYS = 8


def main() -> None:
    dsn, schema, topic, prefix, stop = sys.argv[1:6]
    rounds, slowest = 0, 0.0
    with psycopg.connect(dsn) as conn:
        while not os.path.exists(stop):
            started = time.monotonic()
            for k in range(KEYS):
                key = f"{prefix}k{k}"
                outbox.enqueue(conn, topic, {"k": key, "seq": rounds}, key=key, schema=schema)
            conn.commit()
            slowest = max(slowest, time.monotonic() - started)
            rounds += 1
            time.sleep(0.01)
    print(f"rounds={rounds} slowest_ms={slowest * 1000:.1f}", flush=True)


if __name__ == "__main__":
    main()
