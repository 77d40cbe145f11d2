"""Kafka: a key's order does not rest on librdkafka's message timeout.

librdkafka times a queued message out alone and goes on with the later ones of its partition
(its INTRODUCTION.md, "Message timeout considerations"): a key's event N timed out, N+1 queued
after it and still within its own timeout, delivered when the broker answers again, and N
retried after it. The broker here is librdkafka's own mock cluster (tests.kafka_mock), which
answers an idempotent producer as Apache Kafka does, in a process of its own.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator

import psycopg
import pytest

import outbox
from outbox.events import ClaimedEvent
from outbox.relay.relay import RelayConfig
from outbox.relay.retry import RetryPolicy
from outbox.sinks.base import Outcome, Report, Retry, SinkWrapper
from outbox.sinks.kafka import KafkaSink
from tests.helpers import assert_per_key_order, count, http_get, read_topic, running_relay, wait_for

DEADLINE = 4.0  # the relay's delivery timeout: librdkafka's message timeout before
GAP = 3.0  # seconds between the key's two events: the broker is back in between their deadlines


class MockCluster:
    """tests.kafka_mock: a one-broker cluster with one topic, and its commands."""

    def __init__(self, topic: str) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.kafka_mock", topic],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self._proc.stdout is not None
        self.bootstrap = self._proc.stdout.readline().strip()
        assert self.bootstrap, "the mock cluster did not start"

    def command(self, what: str) -> None:
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(what + "\n")
        self._proc.stdin.flush()
        assert self._proc.stdout.readline().strip() == "ok", what

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        if self._proc.stdout is not None:
            self._proc.stdout.close()


@pytest.fixture
def mock_cluster(topic: str) -> Iterator[MockCluster]:
    cluster = MockCluster(topic)
    try:
        yield cluster
    finally:
        cluster.close()


def _enqueue(dsn: str, schema: str, topic: str, seq: int) -> None:
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, topic, json.dumps({"k": "k", "seq": seq}).encode(), key="k", schema=schema)


def test_a_key_s_next_event_never_lands_ahead_of_one_the_client_would_have_timed_out(
    pg_dsn: str, schema: str, topic: str, mock_cluster: MockCluster, caplog: pytest.LogCaptureFixture
) -> None:
    """The broker goes away with event 1 of key k queued; event 2 is queued 3 s later; the
    broker is back a second past the deadline of event 1, two before that of event 2.

    With librdkafka's message timeout as the deadline (the sink before), event 1 timed out,
    event 2 was delivered when the broker came back, and event 1, retried, landed after it
    (the topic read 0, 2, 1). Now the sink gives the producer up at the deadline of event 1:
    both fail together and go again in order; the relay's order watch saw no violation."""
    config = RelayConfig(
        pg_dsn,
        schema=schema,
        delivery_timeout=DEADLINE,
        lease=30.0,
        poll_interval=0.1,
        retry=RetryPolicy(base=0.2, cap=0.5, max_attempts=1000),
    )
    with caplog.at_level(logging.INFO), running_relay(config, bootstrap=mock_cluster.bootstrap) as relay:
        _enqueue(pg_dsn, schema, topic, 0)
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 1, timeout=30, what="the first event")
        mock_cluster.command("down")
        start = time.monotonic()
        _enqueue(pg_dsn, schema, topic, 1)
        time.sleep(GAP)
        _enqueue(pg_dsn, schema, topic, 2)
        time.sleep(max(0.0, start + DEADLINE + 1.0 - time.monotonic()))
        mock_cluster.command("up")
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 3, timeout=60, what="the three events")
        replaced = relay.stats.sinks_replaced
    messages = read_topic(mock_cluster.bootstrap, topic, 3)
    print("the topic:", [json.loads(m.value)["seq"] for m in messages])
    assert_per_key_order(messages)
    assert replaced >= 1, "the producer was not given up at the deadline"
    assert not [r for r in caplog.records if "per-key order broken" in r.getMessage()]


class _OneLateFailure(SinkWrapper):
    """The real Kafka sink, but the first event of key k is reported failed late, after the key's
    next event went to the broker: what a client that times one message out and delivers the
    next one did."""

    def __init__(self, inner: KafkaSink) -> None:
        super().__init__(inner)
        self.failed = False
        self._late: Report | None = None

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        if event.key == b"k" and not self.failed:
            self.failed = True
            self._late = report
            return None
        return self.inner.produce(event, report)

    def poll(self, timeout: float) -> int | None:
        if self._late is not None:
            late, self._late = self._late, None
            late(Retry("_MSG_TIMED_OUT", "Local: Message timed out"))
        return self.inner.poll(timeout)


def test_a_key_s_event_delivered_ahead_of_its_failed_predecessor_is_an_error_line_and_a_metric(
    pg_dsn: str, schema: str, kafka: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The order watch, on the relay with a real broker: the break is named in one error line
    per event, and counted in outbox_key_order_violations_total for the outbox."""
    with psycopg.connect(pg_dsn) as conn:
        ids = [
            outbox.enqueue(conn, topic, json.dumps({"k": "k", "seq": i}).encode(), key="k", schema=schema)
            for i in range(3)
        ]
    config = RelayConfig(pg_dsn, schema=schema, delivery_timeout=5.0, lease=20.0, poll_interval=0.1,
                         metrics_port=0, retry=RetryPolicy(base=0.2, cap=0.5, max_attempts=1000))  # fmt: skip
    sink = _OneLateFailure(KafkaSink(kafka, delivery_timeout=config.delivery_timeout))
    with caplog.at_level(logging.ERROR), running_relay(config, sink_factory=lambda: sink) as relay:
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 3, timeout=30, what="the three events")
        assert relay.http is not None
        status, metrics = http_get(relay.http.port, "/metrics")
    broken = [r.getMessage() for r in caplog.records if "per-key order broken" in r.getMessage()]
    assert len(broken) == 2, broken  # events 1 and 2 went ahead of event 0
    assert all(str(ids[0]) in line for line in broken)
    assert {str(ids[1]), str(ids[2])} == {line.split()[4] for line in broken}
    assert sink.failed and status == 200
    assert 'outbox_key_order_violations_total{outbox="default"} 2' in metrics
