"""Per-key order across many relay processes; parked keys; partition ownership and fencing."""

from __future__ import annotations

import collections
import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg
import pytest

import outbox
from outbox.events import ClaimedEvent
from outbox.relay import RelayConfig
from outbox.sinks.base import Dead, Outcome, Report, SinkWrapper
from outbox.sinks.kafka import KafkaSink
from tests.helpers import Message, RelayProcess, count, read_topic, running_relay, wait_for

FAST = (
    "--ownership-lease",
    "3",
    "--lease",
    "4",
    "--delivery-timeout",
    "2",
    "--retry-base",
    "0.05",
    "--retry-cap",
    "0.3",
    "--max-attempts",
    "100",
    "--poll-interval",
    "0.2",
    "--batch-size",
    "200",
)


def first_occurrences(messages: list[Message]) -> list[Message]:
    seen: set[str] = set()
    out = []
    for m in messages:
        if m.event_id not in seen:
            seen.add(m.event_id)
            out.append(m)
    return out


def assert_per_key_order(messages: list[Message]) -> None:
    """After keeping the first occurrence of each event-id, every key's seq strictly increases.

    Messages come partition by partition in offset order; one key lives in one
    Kafka partition, so per-key order is the order read.
    """
    last: dict[str, int] = {}
    for m in first_occurrences(messages):
        body = json.loads(m.value)
        k, seq = body["k"], body["seq"]
        assert seq > last.get(k, -1), f"key {k}: seq {seq} after {last.get(k)}"
        last[k] = seq


def owners(dsn: str, schema: str) -> dict[int, str | None]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            f'SELECT partition, owner::text FROM "{schema}".partitions '
            "WHERE expires_at > now() ORDER BY partition"
        ).fetchall()
    return {p: o for p, o in rows}


@pytest.mark.slow
def test_many_processes_kill_restart_join_keep_per_key_order(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    keys, rounds = 200, 250  # 50,000 events
    stop_writing = threading.Event()

    def write() -> None:
        # One transaction per round, so commit order is seq order for every key.
        with psycopg.connect(pg_dsn) as conn:
            for seq in range(rounds):
                if stop_writing.is_set():
                    return
                outbox.enqueue_many(
                    conn,
                    [
                        {"topic": topic, "key": f"k{k}", "payload": {"k": f"k{k}", "seq": seq}}
                        for k in range(keys)
                    ],
                    schema=schema,
                )
                conn.commit()
                time.sleep(0.04)

    writer = threading.Thread(target=write)
    env = {"OUTBOX_TEST_FAILURE_RATE": "0.02"}
    opts = (*FAST, "--sink", "tests.sinks:flaky")
    relays = [RelayProcess(pg_dsn, schema, kafka, *opts, "--name", f"r{i}", env=env) for i in range(3)]
    try:
        writer.start()
        wait_for(lambda: count(pg_dsn, schema, "delivered") > 5000, timeout=60, what="progress")
        relays[0].proc.send_signal(signal.SIGKILL)  # crash mid-run
        relays[0].proc.wait(10)
        relays[0].close()
        time.sleep(1)
        relays[0] = RelayProcess(pg_dsn, schema, kafka, *opts, "--name", "r0-restarted", env=env)
        time.sleep(1)
        relays.append(RelayProcess(pg_dsn, schema, kafka, *opts, "--name", "r3-joined", env=env))
        writer.join()
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=120, what="drain")
        # Every live relay got a share: the joiner and the restarted one included.
        shares = collections.Counter(owners(pg_dsn, schema).values())
        assert len(shares) == 4 and sum(shares.values()) == 64, shares
        for r in relays:
            assert r.stop() == 0, r.output()[-2000:]
    finally:
        stop_writing.set()
        for r in relays:
            r.close()

    n = keys * rounds
    assert count(pg_dsn, schema, "delivered") == n
    assert count(pg_dsn, schema, "dead_letters") == 0
    assert count(pg_dsn, schema, "delivered", "attempts > 1") > 0, "no failure was injected"
    messages = read_topic(kafka, topic, n, timeout=90)
    assert len({m.event_id for m in messages}) == n, "an event was lost"
    assert_per_key_order(messages)


class PoisonSink(SinkWrapper):
    """The real Kafka sink, but events whose payload contains b"poison" are refused for good
    while ``refusing`` is set (a bad record the owner can fix, then redrive)."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__(KafkaSink(bootstrap, delivery_timeout=5))
        self.refusing = True

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        if self.refusing and b"poison" in event.payload:
            return Dead("refused: poison")
        return self.inner.produce(event, report)


def _enqueue_keyed(dsn: str, schema: str, topic: str, key: str, payloads: list[str]) -> None:
    with psycopg.connect(dsn) as conn:
        for seq, p in enumerate(payloads):
            outbox.enqueue(conn, topic, {"k": key, "seq": seq, "p": p}, key=key, schema=schema)
            conn.commit()


def _outbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "outbox", *args], capture_output=True, text=True, timeout=60)


def test_poison_parks_its_key_only_then_redrive_and_skip(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    _enqueue_keyed(pg_dsn, schema, topic, "K", ["ok", "poison", "ok", "ok", "ok"])
    _enqueue_keyed(pg_dsn, schema, topic, "J", ["ok", "poison", "ok"])
    for i in range(10):
        _enqueue_keyed(pg_dsn, schema, topic, f"other{i}", ["ok", "ok"])
    sink = PoisonSink(kafka)
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1)
    with running_relay(config, lambda: sink):
        # Everything but K's and J's later events flows; those are parked.
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 2 + 20, timeout=30)
        time.sleep(1.0)  # a few more claim rounds: parked events must stay parked
        assert count(pg_dsn, schema, "events") == 3 + 1
        assert count(pg_dsn, schema, "dead_letters", "parked") == 2

        status = json.loads(_outbox("status", "--dsn", pg_dsn, "--schema", schema, "--json").stdout)
        parked = {p["key"]: p["waiting"] for p in status["parked_keys"]}
        assert parked == {"K": 3, "J": 1}
        listed = json.loads(
            _outbox("dead", "list", "--dsn", pg_dsn, "--schema", schema, "--key", "K", "--json").stdout
        )
        assert [d["waiting"] for d in listed] == [3]

        sink.refusing = False  # the owner fixed the consumer side; redrive K
        out = _outbox("dead", "redrive", "--dsn", pg_dsn, "--schema", schema, "--key", "K")
        assert out.returncode == 0, out.stderr
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 2 + 20 + 4, timeout=30)
        out = _outbox("dead", "skip", "--dsn", pg_dsn, "--schema", schema, "--key", "J")
        assert out.returncode == 0, out.stderr
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30)
    assert count(pg_dsn, schema, "dead_letters") == 1  # J's poison, skipped, kept
    assert count(pg_dsn, schema, "dead_letters", "parked") == 0
    by_key: dict[str, list[tuple[int, str]]] = collections.defaultdict(list)
    for m in first_occurrences(read_topic(kafka, topic, 2 + 20 + 4 + 1)):
        body = json.loads(m.value)
        by_key[body["k"]].append((body["seq"], body["p"]))
    assert by_key["K"] == [(0, "ok"), (1, "poison"), (2, "ok"), (3, "ok"), (4, "ok")]
    assert by_key["J"] == [(0, "ok"), (2, "ok")]


def test_on_dead_continue_delivers_later_events_and_keeps_the_dead_letter(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    _enqueue_keyed(pg_dsn, schema, topic, "K", ["ok", "poison", "ok", "ok"])
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1, on_dead="continue")
    with running_relay(config, lambda: PoisonSink(kafka)):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30)
    assert count(pg_dsn, schema, "dead_letters", "NOT parked") == 1
    seqs = [json.loads(m.value)["seq"] for m in read_topic(kafka, topic, 3)]
    assert seqs == [0, 2, 3]


def test_dead_commands_validate_their_arguments(pg_dsn: str, schema: str) -> None:
    out = _outbox("dead", "redrive", "--dsn", pg_dsn, "--schema", schema)
    assert out.returncode == 2 and "--key" in out.stderr
    out = _outbox("dead", "skip", "--dsn", pg_dsn, "--schema", schema, "42")
    assert out.returncode == 1 and "no dead letter matches" in out.stdout


@pytest.mark.slow
def test_dead_relay_partitions_taken_over_within_the_lease(pg_dsn: str, schema: str, kafka: str) -> None:
    lease = 3.0
    a = RelayProcess(pg_dsn, schema, kafka, *FAST, "--name", "a")
    b = RelayProcess(pg_dsn, schema, kafka, *FAST, "--name", "b")
    try:
        wait_for(
            lambda: len(set(owners(pg_dsn, schema).values())) == 2 and len(owners(pg_dsn, schema)) == 64,
            timeout=30,
            what="two owners",
        )
        with psycopg.connect(pg_dsn) as conn:
            ids = dict(conn.execute(f'SELECT name, id::text FROM "{schema}".relays').fetchall())
        killed_at = time.monotonic()
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait(10)

        def one_owner() -> bool:
            now = owners(pg_dsn, schema)
            return len(now) == 64 and len(set(now.values())) == 1

        wait_for(one_owner, timeout=30, interval=0.1, what="takeover")
        took = time.monotonic() - killed_at
        assert set(owners(pg_dsn, schema).values()) == {ids["b"]}
        # Within the lease, plus one heartbeat of the survivor (lease/5) and polling slack.
        assert took <= lease + lease / 5 + 1.0, f"takeover took {took:.1f}s"
        assert b.stop() == 0
    finally:
        a.close()
        b.close()


@pytest.mark.slow
def test_paused_relay_is_fenced_and_order_holds(pg_dsn: str, schema: str, kafka: str, topic: str) -> None:
    keys, rounds = 50, 600
    with psycopg.connect(pg_dsn) as conn:
        for seq in range(rounds):
            outbox.enqueue_many(
                conn,
                [
                    {"topic": topic, "key": f"k{k}", "payload": {"k": f"k{k}", "seq": seq}}
                    for k in range(keys)
                ],
                schema=schema,
            )
            conn.commit()
    n = keys * rounds
    # A slow-ish pace (small batches, one in flight) so that the pause lands mid-run.
    opts = (*FAST, "--batch-size", "20", "--batches-in-flight", "1")
    a = RelayProcess(pg_dsn, schema, kafka, *opts, "--name", "a")
    fences: list[Any] = []
    try:
        wait_for(lambda: count(pg_dsn, schema, "delivered") > 200, timeout=30)
        b = RelayProcess(pg_dsn, schema, kafka, *opts, "--name", "b")
        wait_for(lambda: len(set(owners(pg_dsn, schema).values())) == 2, timeout=30, what="rebalance")
        a.proc.send_signal(signal.SIGSTOP)  # past its ownership lease (3 s) and batch lease (4 s)
        paused_at = time.monotonic()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            while time.monotonic() - paused_at < 8:
                fences += conn.execute(
                    f'SELECT partition, fenced_until IS NOT NULL FROM "{schema}".partitions '
                    "WHERE previous_owner IS NOT NULL AND fenced_until > now()"
                ).fetchall()
                time.sleep(0.2)
        a.proc.send_signal(signal.SIGCONT)
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=120, what="drain")
        assert a.stop() == 0 and b.stop() == 0
        a_log = a.output()
    finally:
        a.close()
        if "b" in locals():
            b.close()
    # b took a's partitions while a's sessions were alive: they were fenced, not claimed at once.
    assert fences, "no partition was fenced during the takeover"
    assert "lost ownership" in a_log or "refused" in a_log, a_log[-2000:]
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(f'SELECT count(*), count(DISTINCT id) FROM "{schema}".delivered').fetchone()
    assert row == (n, n), "an event was archived twice or lost"
    messages = read_topic(kafka, topic, n, timeout=90)
    assert len({m.event_id for m in messages}) == n
    assert_per_key_order(messages)


@pytest.mark.slow
def test_ordering_none_four_processes_no_loss_no_duplicates(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    n = 20_000
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn, [{"topic": topic, "key": f"k{i % 100}", "payload": str(i)} for i in range(n)], schema=schema
        )
    relays = [
        RelayProcess(pg_dsn, schema, kafka, "--ordering", "none", "--batch-size", "200") for _ in range(4)
    ]
    try:
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="drain")
        for r in relays:
            assert r.stop() == 0
    finally:
        for r in relays:
            r.close()
    messages = read_topic(kafka, topic, n, timeout=60)
    assert len(messages) == n, "duplicates without a crash"
    assert len({m.event_id for m in messages}) == n
    assert count(pg_dsn, schema, "delivered") == n


def test_idle_relay_keeps_heartbeating_with_a_long_poll_interval(
    pg_dsn: str, schema: str, kafka: str
) -> None:
    """An idle relay polling every 60 s must still renew its 2 s ownership leases."""
    import time

    import psycopg

    from outbox.relay import RelayConfig
    from tests.helpers import running_relay, wait_for

    config = RelayConfig(
        pg_dsn,
        schema=schema,
        poll_interval=60,
        ownership_lease=2.0,
        lease=3.0,
        delivery_timeout=1.0,
        notify=False,
    )

    def owned() -> int:
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute(
                f'SELECT count(*) FROM "{schema}".partitions WHERE expires_at > now()'
            ).fetchone()
            return int(row[0]) if row else 0

    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: owned() == 64, timeout=10)
        time.sleep(5)  # more than two leases of idling
        assert owned() == 64, "the idle relay let its leases lapse"
