"""The delivery latency counts from the commit where PostgreSQL keeps it (WAL capture; table
capture with track_commit_timestamp on), from the creation otherwise, and says which it holds.

Each test writes events in a transaction held open for HOLD seconds: their creation is that
long before their commit. The relay delivers them within a second of the commit, so a latency
from the commit falls under 1 s and one from the creation above HOLD."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import psycopg
import pytest

import outbox
from outbox.relay.relay import RelayConfig
from outbox.store.migrate import migrate
from tests.helpers import http_get, running_relay, wait_for

HOLD = 2.5  # seconds between the events' creation and their commit
EVENTS = 20


def _write_and_hold(dsn: str, schema: str, topic: str) -> None:
    with psycopg.connect(dsn) as conn:
        outbox.enqueue_many(
            conn,
            [{"topic": topic, "key": f"k{i}", "payload": {"i": i}} for i in range(EVENTS)],
            schema=schema,
        )
        time.sleep(HOLD)  # committed as the block ends


def _latency(text: str, since: str) -> tuple[float, float]:
    """(observations, those under 1 s) of the default outbox's histogram labelled ``since``."""

    def sample(name: str, extra: str = "") -> float:
        m = re.search(rf'^{name}\{{outbox="default",since="{since}"{extra}\}} (\S+)$', text, re.MULTILINE)
        return float(m.group(1)) if m else 0.0

    return sample("outbox_delivery_latency_seconds_count"), sample(
        "outbox_delivery_latency_seconds_bucket", ',le="1"'
    )


def _delivered_metrics(dsn: str, schema: str, kafka: str, topic: str) -> str:
    """The relay's metrics once it delivered the events (each observed as its batch finished)."""
    config = RelayConfig(dsn, schema=schema, metrics_port=0, poll_interval=0.1)
    with running_relay(config, bootstrap=kafka) as relay:
        _write_and_hold(dsn, schema, topic)
        assert relay.http is not None
        port = relay.http.port

        def observed() -> float:
            text = http_get(port, "/metrics")[1]
            return _latency(text, "commit")[0] + _latency(text, "created")[0]

        wait_for(lambda: observed() == EVENTS, timeout=30, what="every delivery observed")
        status, text = http_get(port, "/metrics")
    assert status == 200
    return text


def test_table_capture_without_commit_times_counts_from_the_creation_and_says_so(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute("SHOW track_commit_timestamp").fetchone()
    if row != ("off",):
        pytest.skip("this server keeps commit times")  # the matrix's servers do not
    text = _delivered_metrics(pg_dsn, schema, kafka, topic)
    assert _latency(text, "created") == (EVENTS, 0)  # every one, each over HOLD
    assert _latency(text, "commit") == (0, 0)


@pytest.fixture(scope="module")
def commit_times_dsn() -> Iterator[str]:
    """A server that keeps commit times (track_commit_timestamp needs a restart to turn on)."""
    from tests.pgserver import Server

    server = Server("18", wal_level="replica", settings={"track_commit_timestamp": "on"}).start()
    try:
        yield server.dsn
    finally:
        server.remove()


def test_table_capture_with_commit_times_counts_from_the_commit(
    commit_times_dsn: str, kafka: str, topic: str
) -> None:
    schema = "commit_times"
    with psycopg.connect(commit_times_dsn, autocommit=True) as conn:
        migrate(conn, schema)
    text = _delivered_metrics(commit_times_dsn, schema, kafka, topic)
    assert _latency(text, "commit") == (EVENTS, EVENTS)  # every one, each under a second
    assert _latency(text, "created") == (0, 0)


def test_wal_capture_counts_from_the_commit(wal_dsn: str, wal_schema: str, kafka: str, topic: str) -> None:
    text = _delivered_metrics(wal_dsn, wal_schema, kafka, topic)
    assert _latency(text, "commit") == (EVENTS, EVENTS)
    assert _latency(text, "created") == (0, 0)
