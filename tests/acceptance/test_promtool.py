"""``/metrics`` checked by Prometheus's own linter: ``promtool check metrics`` (Debian package
``prometheus``, installed by ./scripts/bootstrap) on a scrape of a running relay after
deliveries, retries and a dead letter, so every family has samples to check."""

from __future__ import annotations

import shutil
import subprocess

import psycopg

import outbox
from outbox.relay.config import RelayConfig
from outbox.relay.retry import RetryPolicy
from outbox.sinks.kafka import KafkaSink
from tests.helpers import count, http_get, running_relay, wait_for
from tests.sinks import AnyFlakySink


def test_metrics_pass_promtool_check_metrics(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is missing: ./scripts/bootstrap installs the Debian package prometheus"
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn,
            [{"topic": topic, "payload": {"i": i}, "key": f"k{i % 5}"} for i in range(200)],
            schema=schema,
        )
        outbox.enqueue(conn, "not a valid topic!", b"x", key="poison", schema=schema)  # dead at once
        conn.commit()
    config = RelayConfig(
        pg_dsn, schema=schema, metrics_port=0, poll_interval=0.1, retry=RetryPolicy(base=0.05, cap=0.2)
    )

    def flaky() -> AnyFlakySink:
        return AnyFlakySink(KafkaSink(kafka, delivery_timeout=config.delivery_timeout), 0.2)

    with running_relay(config, flaky) as relay:
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="drain")
        assert relay.stats.retried > 0 and count(pg_dsn, schema, "dead_letters") == 1
        status, body = http_get(relay.http.port, "/metrics")  # type: ignore[union-attr]
    assert status == 200
    assert "outbox_events_dead_total{" in body and "outbox_delivery_errors_total{" in body, body[:800]
    checked = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
