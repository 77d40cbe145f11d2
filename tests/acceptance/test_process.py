"""The relay as a real process: SIGKILL mid-batch loses nothing; SIGTERM exits 0 in time."""

from __future__ import annotations

import collections
import signal
import time

import psycopg
import pytest

import outbox
from tests.helpers import RelayProcess, count, read_topic, wait_for

BATCH = 500
IN_FLIGHT = 2


def _enqueue(dsn: str, schema: str, topic: str, n: int) -> None:
    with psycopg.connect(dsn) as conn:
        for start in range(0, n, 5000):
            outbox.enqueue_many(
                conn,
                [
                    {"topic": topic, "payload": b"p" * 200, "key": f"k{i % 100}"}
                    for i in range(start, min(n, start + 5000))
                ],
                schema=schema,
            )
            conn.commit()


@pytest.mark.slow
def test_sigkill_mid_batch_then_restart_delivers_everything_once_in_archive(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    n = 60_000
    _enqueue(pg_dsn, schema, topic, n)
    opts = ("--batch-size", str(BATCH), "--batches-in-flight", str(IN_FLIGHT))
    with RelayProcess(pg_dsn, schema, kafka, *opts) as first:
        wait_for(lambda: count(pg_dsn, schema, "delivered") > 5000, timeout=60, what="progress")
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
    archived_at_kill = count(pg_dsn, schema, "delivered")
    assert archived_at_kill < n, "the relay finished before it was killed; the test proves nothing"

    with RelayProcess(pg_dsn, schema, kafka, *opts) as second:
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=120, what="drain")
        second.proc.send_signal(signal.SIGTERM)
        assert second.proc.wait(30) == 0, second.output()

    with psycopg.connect(pg_dsn) as conn:
        per_id = conn.execute(
            f'SELECT count(*), count(DISTINCT id), count(DISTINCT event_id) FROM "{schema}".delivered'
        ).fetchone()
    assert per_id == (n, n, n), "every event archived exactly once"
    messages = read_topic(kafka, topic, n, timeout=60)
    copies = collections.Counter(m.event_id for m in messages)
    assert len(copies) == n, "an event never reached the broker"
    duplicates = sum(c - 1 for c in copies.values())
    # Only the batches in flight at the kill may be sent twice.
    assert duplicates <= BATCH * IN_FLIGHT


@pytest.mark.slow
def test_sigterm_exits_zero_within_grace_and_loses_nothing(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    n = 40_000
    _enqueue(pg_dsn, schema, topic, n)
    grace = 5.0
    with RelayProcess(pg_dsn, schema, kafka, "--grace", str(grace), "--batch-size", "500") as relay:
        wait_for(lambda: count(pg_dsn, schema, "delivered") > 2000, timeout=60, what="progress")
        sent_at = time.monotonic()
        relay.proc.send_signal(signal.SIGTERM)
        code = relay.proc.wait(grace + 10)
        took = time.monotonic() - sent_at
        output = relay.output()
    assert code == 0, output
    assert took < grace + 3, f"stopped after {took:.1f}s, grace was {grace}s"
    assert "relay stopped" in output

    archived, pending = count(pg_dsn, schema, "delivered"), count(pg_dsn, schema, "events")
    assert archived + pending == n, "an event vanished at shutdown"
    # Everything archived really reached the broker.
    with psycopg.connect(pg_dsn) as conn:
        archived_ids = {str(r[0]) for r in conn.execute(f'SELECT event_id FROM "{schema}".delivered')}
    on_kafka = {m.event_id for m in read_topic(kafka, topic, archived, timeout=60)}
    assert archived_ids <= on_kafka
