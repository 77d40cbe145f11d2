"""``python -m tests.inbox_consumer DSN SCHEMA BOOTSTRAP TOPIC GROUP [STALL_AT MARKER]``: a
consumer built on ``outbox.inbox.consume_kafka``, as an app writes one, for tests that kill it.

The handler's effect is a row in ``<schema>.effects`` (no unique constraint: a second effect
of one event would show). With STALL_AT, the handler of the STALL_AT-th message it runs
creates MARKER and hangs inside its transaction, to be SIGKILLed there.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from outbox.inbox import Delivery, consume_kafka

# Tansu completes a group join after half the session timeout: keep it short.
GROUP_SETTINGS = {"auto.offset.reset": "earliest", "session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


def main(argv: list[str]) -> int:
    dsn, schema, bootstrap, topic, group = argv[:5]
    stall_at = int(argv[5]) if len(argv) > 5 else 0
    marker = Path(argv[6]) if len(argv) > 6 else None
    insert = sql.SQL("INSERT INTO {}.effects (event_id, k, seq) VALUES (%s, %s, %s)").format(
        sql.Identifier(schema)
    )
    runs = 0

    def handler(conn: psycopg.Connection[Any], delivery: Delivery) -> None:
        nonlocal runs
        body = json.loads(delivery.value)
        conn.execute(insert, (delivery.event_id, body["k"], body["seq"]))
        runs += 1
        if runs == stall_at and marker is not None:
            marker.touch()
            time.sleep(600)  # SIGKILLed here, its effect uncommitted

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    stats = consume_kafka(
        {"bootstrap.servers": bootstrap, "group.id": group, **GROUP_SETTINGS},
        [topic],
        handler,
        dsn=dsn,
        schema=schema,
    )
    print(f"handled={stats.handled} duplicates={stats.duplicates} failures={stats.failures}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
