"""Per-key order in one relay: parked keys, redrive and skip, and ownership kept while idle."""

from __future__ import annotations

import collections
import json

import psycopg

import outbox
from outbox import dead, status
from outbox.events import ClaimedEvent
from outbox.relay import RelayConfig
from outbox.sinks.base import Dead, Outcome, Report, SinkWrapper
from outbox.sinks.kafka import KafkaSink
from tests.helpers import count, first_occurrences, owners, read_topic, running_relay, wait_for


class PoisonSink(SinkWrapper):
    """The real Kafka sink, but events whose payload contains b"poison" are refused for good
    while ``refusing`` is set (a bad record the owner can fix, then redrive)."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__(KafkaSink(bootstrap, delivery_timeout=5))
        self.refusing = True

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        if self.refusing and b"poison" in event.payload:
            return Dead("poison", "refused: poison")
        return self.inner.produce(event, report)


def _enqueue_keyed(dsn: str, schema: str, topic: str, key: str, payloads: list[str]) -> None:
    with psycopg.connect(dsn) as conn:
        for seq, p in enumerate(payloads):
            outbox.enqueue(conn, topic, {"k": key, "seq": seq, "p": p}, key=key, schema=schema)
            conn.commit()


def test_poison_parks_its_key_only_then_redrive_and_skip(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    _enqueue_keyed(pg_dsn, schema, topic, "K", ["ok", "poison", "ok", "ok", "ok"])
    _enqueue_keyed(pg_dsn, schema, topic, "J", ["ok", "poison", "ok"])
    for i in range(10):
        _enqueue_keyed(pg_dsn, schema, topic, f"other{i}", ["ok", "ok"])
    sink = PoisonSink(kafka)
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1)
    with running_relay(config, lambda: sink) as relay, psycopg.connect(pg_dsn) as conn:
        # Everything but K's and J's later events flows; those are parked.
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 2 + 20, timeout=30)
        claims = relay.stats.claims
        wait_for(lambda: relay.stats.claims >= claims + 5, timeout=10, what="more claim rounds")
        assert count(pg_dsn, schema, "events") == 3 + 1, "a parked event was claimed"
        assert count(pg_dsn, schema, "dead_letters", "parked") == 2

        report = status.collect(conn, schema)
        assert {p["key"]: p["waiting"] for p in report["parked_keys"]} == {"K": 3, "J": 1}
        chosen = dead.select(conn, schema, dead.Selector(key=b"K"))
        assert [d["waiting"] for d in dead.details(conn, schema, chosen)] == [3]

        sink.refusing = False  # the owner fixed the consumer side; redrive K
        assert dead.redrive(conn, schema, chosen) == 1
        conn.commit()
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 2 + 20 + 4, timeout=30)
        assert dead.skip(conn, schema, dead.select(conn, schema, dead.Selector(key=b"J"))) == 1
        conn.commit()
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


def test_idle_relay_keeps_heartbeating_with_a_long_poll_interval(
    pg_dsn: str, schema: str, kafka: str
) -> None:
    """An idle relay polling every 60 s must still renew its 2 s ownership leases."""
    lease = 2.0
    config = RelayConfig(
        pg_dsn,
        schema=schema,
        poll_interval=60,
        ownership_lease=lease,
        lease=3.0,
        delivery_timeout=1.0,
        notify=False,
    )

    def leases() -> tuple[float, object]:
        """(earliest lease end, latest acquisition): a lapse would show as a new acquisition."""
        with psycopg.connect(pg_dsn) as conn:
            row = conn.execute(
                psycopg.sql.SQL(
                    "SELECT extract(epoch FROM min(expires_at))::float8, max(acquired_at) FROM {}.partitions"
                ).format(psycopg.sql.Identifier(schema))
            ).fetchone()
            assert row is not None
            return float(row[0] or 0.0), row[1]

    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: len(owners(pg_dsn, schema)) == 64, timeout=10)
        first_end, acquired = leases()
        # Renewed past two whole leases while idle ...
        wait_for(lambda: leases()[0] > first_end + 2 * lease, timeout=10, interval=0.2, what="renewals")
        # ... without ever lapsing (a lapsed partition is acquired anew).
        assert len(owners(pg_dsn, schema)) == 64 and leases()[1] == acquired, (
            "the idle relay let a lease lapse"
        )
