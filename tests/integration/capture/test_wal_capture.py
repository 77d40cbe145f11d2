"""WAL capture (issue 30): events emitted to the WAL, read from the outbox's slot, delivered.

Against a PostgreSQL with wal_level=logical (the ``wal_dsn`` fixture: the matrix's servers, or
one of this worker's own) and the real Kafka-protocol broker."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox import capture
from outbox.capture import wal_message
from outbox.errors import ConfigError
from outbox.events import ClaimedEvent, encode_event
from outbox.fleet.fleet import Fleet
from outbox.relay.relay import RelayConfig
from outbox.relay.retry import RetryPolicy
from outbox.sinks.base import Dead, Outcome, Report, Retry, SinkWrapper
from outbox.sinks.kafka import KafkaSink
from outbox.store.migrate import migrate
from outbox.store.outboxes import Outbox
from tests.helpers import (
    RelayProcess,
    assert_per_key_order,
    count,
    first_occurrences,
    read_topic,
    recorded_slot,
    running_relay,
    wait_for,
    waiting_on_a_lock,
)


def test_enqueue_in_wal_mode_writes_no_row_and_the_relay_delivers_it_byte_exact(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    payloads = [b"\x00\xffraw bytes\n", {"order": 7, "lines": ["a", "b"]}, "text \u00e9"]
    with psycopg.connect(wal_dsn) as conn:
        ids = [
            outbox.enqueue(
                conn, topic, p, key=f"k{i % 2}", headers={"h": "v"}, schema=wal_schema, type="order.placed"
            )
            for i, p in enumerate(payloads)
        ]
        with conn.transaction(force_rollback=True):  # a savepoint rolled back: never delivered
            outbox.enqueue(conn, topic, b"rolled back", schema=wal_schema)
    with psycopg.connect(wal_dsn) as conn:
        outbox.enqueue(conn, topic, b"whole transaction rolled back", schema=wal_schema)
        conn.rollback()
    assert count(wal_dsn, wal_schema, "events") == 0  # nothing went into the table
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema), bootstrap=kafka):
        messages = read_topic(kafka, topic, 3)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 3, timeout=30, what="archive")
    assert len(messages) == 3  # the rolled-back ones never
    by_id = {m.event_id: m for m in messages}
    first, second, third = (by_id[str(i)] for i in ids)
    assert first.value == b"\x00\xffraw bytes\n"
    assert json.loads(second.value) == {"order": 7, "lines": ["a", "b"]}
    assert third.value == "text \u00e9".encode()
    assert all(m.headers["h"] == b"v" for m in messages)
    assert [first.key, second.key, third.key] == [b"k0", b"k1", b"k0"]
    assert first.offset < third.offset  # one key: commit order
    with psycopg.connect(wal_dsn) as conn:
        archived = conn.execute(
            f'SELECT event_id::text, type, sink_partition IS NOT NULL FROM "{wal_schema}".delivered ORDER BY id'
        ).fetchall()
        slot = conn.execute(
            f"SELECT confirmed_flush_lsn >= (SELECT lsn FROM {_position(wal_schema)} AS p) "
            "FROM pg_replication_slots WHERE slot_name = %s",
            (recorded_slot(wal_dsn, wal_schema),),
        ).fetchone()
    assert archived == [(str(i), "order.placed", True) for i in ids]
    assert slot == (True,)


def _sync_writes(stack_name: str, dsn: str, schema: str, topic: str) -> list[str]:
    from tests.stacks import SyncStack

    stack = SyncStack(stack_name, dsn)
    committed: list[str] = []
    try:
        with stack.tx() as conn:
            committed.append(
                str(outbox.enqueue(conn, topic, {"stack": stack_name, "n": 0}, key="a", schema=schema))
            )
            with stack.savepoint():
                outbox.enqueue(conn, topic, b"rolled back (savepoint)", key="a", schema=schema)
            batch = [{"topic": topic, "payload": {"stack": stack_name, "n": n}, "key": "a"} for n in (1, 2)]
            batch.append({"topic": topic, "payload": {"stack": stack_name, "n": 3}, "delay": 0.2})
            committed += map(str, outbox.enqueue_many(conn, batch, schema=schema))
        with stack.rollback_tx() as conn:
            outbox.enqueue(conn, topic, b"rolled back (transaction)", schema=schema)
    finally:
        stack.close()
    return committed


async def _async_writes(stack_name: str, dsn: str, schema: str, topic: str) -> list[str]:
    from tests.stacks import AsyncStack

    stack = AsyncStack(stack_name, dsn)
    committed: list[str] = []
    async with stack.connection() as conn:
        async with stack.tx(conn):
            event_id = await outbox.enqueue_async(
                conn, topic, {"stack": stack_name, "n": 0}, key="a", schema=schema
            )
            committed.append(str(event_id))
            async with stack.savepoint(conn):
                await outbox.enqueue_async(conn, topic, b"rolled back (savepoint)", key="a", schema=schema)
            batch = [{"topic": topic, "payload": {"stack": stack_name, "n": n}, "key": "a"} for n in (1, 2)]
            batch.append({"topic": topic, "payload": {"stack": stack_name, "n": 3}, "delay": 0.2})
            committed += map(str, await outbox.enqueue_many_async(conn, batch, schema=schema))
        async with stack.tx(conn, rollback=True):
            await outbox.enqueue_async(conn, topic, b"rolled back (transaction)", schema=schema)
    return committed


def test_every_writer_stack_in_wal_mode_delivers_what_committed_and_never_what_rolled_back(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """Each stack's enqueue and enqueue_many in WAL mode (the delayed event waits in the table);
    a savepoint and a transaction rolled back are never delivered. Django writes through the
    psycopg and psycopg2 writers (its connection.connection), run here directly: Django itself
    is configured once per process, for the suite's main database."""
    import asyncio

    from tests.stacks import ASYNC_STACKS, SYNC_STACKS

    committed: list[str] = []
    for name in SYNC_STACKS:
        if name != "django":
            committed += _sync_writes(name, wal_dsn, wal_schema, topic)
    for name in ASYNC_STACKS:
        committed += asyncio.run(_async_writes(name, wal_dsn, wal_schema, topic))
    stacks = len(SYNC_STACKS) - 1 + len(ASYNC_STACKS)
    assert len(committed) == 4 * stacks
    assert count(wal_dsn, wal_schema, "events") == stacks  # only the delayed ones are rows
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        messages = read_topic(kafka, topic, len(committed))
    assert sorted(m.event_id for m in messages) == sorted(committed)  # once each, nothing else
    order: dict[str, list[int]] = {}
    for m in messages:
        body = json.loads(m.value)
        if m.key == b"a":
            order.setdefault(body["stack"], []).append(body["n"])
    assert all(ns == [0, 1, 2] for ns in order.values()) and len(order) == stacks, order


class _RefusesKey(SinkWrapper):
    """The real Kafka sink, but key ``bad``'s events fail (retried) while ``refusing`` holds, and
    a payload with b"poison" is refused for good (a dead letter that parks its key)."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__(KafkaSink(bootstrap, delivery_timeout=5))
        self.refusing = True
        self.failed = 0

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        if b"poison" in event.payload:
            return Dead("poison", "refused: poison")
        if self.refusing and event.key == b"bad":
            self.failed += 1
            return Retry("injected", "injected failure of key bad")
        return self.inner.produce(event, report)


def _write_keyed(dsn: str, schema: str, topic: str, keys: list[str], rounds: int, start: int = 0) -> None:
    with psycopg.connect(dsn) as conn:
        for seq in range(start, start + rounds):
            for k in keys:
                outbox.enqueue(conn, topic, {"k": k, "seq": seq}, key=k, schema=schema)
            conn.commit()


def test_a_failing_key_goes_to_the_table_and_comes_back_in_order_while_other_keys_flow(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    sink = _RefusesKey(kafka)
    config = RelayConfig(
        wal_dsn, schema=wal_schema, poll_interval=0.1, retry=RetryPolicy(base=0.1, cap=0.3, max_attempts=1000)
    )
    keys = ["bad", "good1", "good2"]
    _write_keyed(wal_dsn, wal_schema, topic, keys, 5)
    with running_relay(config, lambda: sink):
        # The other keys flow from the WAL; bad's first event failed into the table, and its
        # later ones followed it there (they never overtake it), where they wait.
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 10, timeout=30, what="good keys")
        wait_for(
            lambda: count(wal_dsn, wal_schema, "events", "key = 'bad'") == 5, timeout=30, what="bad in table"
        )
        _write_keyed(wal_dsn, wal_schema, topic, keys, 5, start=5)  # more, while bad still fails
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 20, timeout=30, what="good keys again")
        wait_for(
            lambda: count(wal_dsn, wal_schema, "events", "key = 'bad'") == 10, timeout=30, what="bad: 10"
        )
        wait_for(lambda: sink.failed >= 3, timeout=10, what="retries from the table, with their backoff")
        sink.refusing = False
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 30, timeout=30, what="bad delivered")
        _write_keyed(wal_dsn, wal_schema, topic, keys, 2, start=10)  # the key is clear: from the WAL again
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 36, timeout=30, what="all")
    messages = read_topic(kafka, topic, 36)
    assert_per_key_order(messages)
    assert sorted(json.loads(m.value)["seq"] for m in first_occurrences(messages) if m.key == b"bad") == list(
        range(12)
    )
    assert count(wal_dsn, wal_schema, "events") == 0


def test_a_dead_letter_from_the_wal_parks_its_key_and_redrive_releases_it(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    sink = _RefusesKey(kafka)
    sink.refusing = False
    config = RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1, on_dead="park")
    with psycopg.connect(wal_dsn) as conn:
        for seq, body in enumerate(["ok", "poison", "ok", "ok"]):
            outbox.enqueue(conn, topic, {"k": "K", "seq": seq, "p": body}, key="K", schema=wal_schema)
            outbox.enqueue(conn, topic, {"k": "J", "seq": seq, "p": "ok"}, key="J", schema=wal_schema)
            conn.commit()
    with running_relay(config, lambda: sink):
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 5, timeout=30, what="J's 4 and K's first")
        wait_for(lambda: count(wal_dsn, wal_schema, "dead_letters") == 1, timeout=30, what="the dead letter")
        wait_for(lambda: count(wal_dsn, wal_schema, "events", "key = 'K'") == 2, timeout=30, what="K parked")
        _write_keyed(wal_dsn, wal_schema, topic, ["K"], 1, start=4)  # behind the parked letter too
        wait_for(
            lambda: count(wal_dsn, wal_schema, "events", "key = 'K'") == 3, timeout=30, what="K: 3 parked"
        )
    assert count(wal_dsn, wal_schema, "delivered") == 5


class _Gated(SinkWrapper):
    """The real Kafka sink, but events whose payload names a gate wait, unsent, until the test
    opens it (they are sent from the relay loop's next poll)."""

    def __init__(self, bootstrap: str) -> None:
        super().__init__(KafkaSink(bootstrap, delivery_timeout=5))
        self.closed: set[str] = set()
        self.waiting: dict[str, list[tuple[ClaimedEvent, Report]]] = {}
        self._lock = threading.Lock()

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        gate = json.loads(event.payload).get("gate")
        with self._lock:
            if gate in self.closed:
                self.waiting.setdefault(gate, []).append((event, report))
                return None
        return self.inner.produce(event, report)

    def open(self, gate: str) -> None:
        with self._lock:
            self.closed.discard(gate)

    def poll(self, timeout: float) -> int | None:
        with self._lock:
            due = [w for gate, ws in self.waiting.items() if gate not in self.closed for w in ws]
            self.waiting = {g: ws for g, ws in self.waiting.items() if g in self.closed}
        for event, report in due:
            outcome = self.inner.produce(event, report)
            if outcome is not None:
                report(outcome)
        return self.inner.poll(timeout)


def test_a_key_held_into_the_table_stays_held_until_its_batch_commits(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """A WAL event held behind its key's older row in the table (W1) goes into the table only when
    its batch commits. If that older row is delivered meanwhile, the key's next WAL event (W2)
    must still wait behind W1. (Found by the fault harness's blackhole row in WAL capture: the
    standby relay drained the table's retries while the reader's batch was in flight, and W2
    reached Kafka before W1.)"""
    sink = _Gated(kafka)
    sink.closed = {"T", "X"}
    config = RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.05)

    def emit(*events: tuple[str, int, str, float | None]) -> None:
        with psycopg.connect(wal_dsn) as conn:
            for key, seq, gate, delay in events:
                body = {"k": key, "seq": seq, "gate": gate}
                outbox.enqueue(conn, topic, body, key=key, schema=wal_schema, delay=delay)
            conn.commit()

    emit(("K", 0, "T", 0.01))  # delayed: a row in the table, the oldest of key K
    with running_relay(config, lambda: sink) as relay:
        wait_for(lambda: "T" in sink.waiting, timeout=30, what="T claimed from the table, gated")
        emit(("K", 1, "", None), ("Y", 0, "X", None))  # one WAL transaction: W1 held, X gated
        wait_for(lambda: "X" in sink.waiting, timeout=30, what="the WAL batch of W1 and X in flight")
        sink.open("T")  # T delivered and archived: the table holds nothing of K now
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 1, timeout=30, what="T archived")
        assert count(wal_dsn, wal_schema, "events", "key = 'K'") == 0
        claimed = relay.stats.claimed
        emit(("K", 2, "", None))  # W2, from the WAL, while W1 waits in the batch still in flight
        wait_for(lambda: relay.stats.claimed > claimed, timeout=30, what="W2 read and sent (or held)")
        sink.open("X")
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 4, timeout=30, what="everything")
    messages = read_topic(kafka, topic, 4)
    order = [json.loads(m.value)["seq"] for m in first_occurrences(messages) if m.key == b"K"]
    assert order == [0, 1, 2], f"key K reached Kafka as {order}"
    assert count(wal_dsn, wal_schema, "events") == 0


def test_a_wal_batch_is_committed_when_it_finishes(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """A WAL batch's archive rows and position are committed when it finishes (in one round trip,
    psycopg's pipeline mode), and stay through the table's claims that follow on the same
    session (an empty claim rolls back: work left open there would go with it)."""
    # One session, so that the table's claims run where the WAL batches finished.
    config = RelayConfig(
        wal_dsn, schema=wal_schema, poll_interval=0.05, max_connections=1, max_batches_in_flight=1
    )
    with running_relay(config, bootstrap=kafka) as relay:
        wait_for(lambda: relay.ready()[0], timeout=30, what="ready")
        for i in range(3):
            with psycopg.connect(wal_dsn) as conn:
                # Keyless: no key check opens the batch's transaction before it finishes.
                outbox.enqueue(conn, topic, {"seq": i}, schema=wal_schema)
                conn.commit()
            wait_for(
                lambda i=i: count(wal_dsn, wal_schema, "delivered") == i + 1,  # type: ignore[misc]
                timeout=10,
                what=f"event {i} archived, committed",
            )
        claims = relay.stats.claims
        wait_for(lambda: relay.stats.claims >= claims + 3, timeout=30, what="table claims on the sessions")
        assert count(wal_dsn, wal_schema, "delivered") == 3
        lsn = _rows(wal_dsn, f"SELECT lsn IS NOT NULL FROM {_position(wal_schema)} AS p")
        assert lsn == [(True,)]


# The handed-on position as a number (the subquery of _position).
_LSN = "SELECT (coalesce(part_commit, lsn) - '0/0'::pg_lsn)::bigint FROM {} AS p"


def _one_delivered(dsn: str, schema: str, topic: str) -> list[tuple[Any, ...]]:
    """One event written and archived through the running relay; the handed-on position then."""
    with psycopg.connect(dsn) as conn:
        outbox.enqueue(conn, topic, {"first": True}, key="k", schema=schema)
        conn.commit()
    wait_for(lambda: count(dsn, schema, "delivered") == 1, what="the first WAL event")
    return _rows(dsn, _LSN.format(_position(schema)))


@contextlib.contextmanager
def _archive_locked(dsn: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    """A session holding the archive locked (roll it back to let go)."""
    with psycopg.connect(dsn) as locker:
        locker.execute(
            sql.SQL("LOCK TABLE {}.delivered IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(schema))
        )
        yield locker


def _two_batches_behind_the_lock(conn: psycopg.Connection[Any], dsn: str, schema: str, topic: str) -> None:
    """Event seq 0, committed and read: its batch's finish waits on the locked archive; then seq 1,
    read as the next batch."""
    outbox.enqueue(conn, topic, {"seq": 0}, key="k", schema=schema)
    conn.commit()
    wait_for(lambda: waiting_on_a_lock(dsn, schema), what="the first WAL batch's finish")
    outbox.enqueue(conn, topic, {"seq": 1}, key="k", schema=schema)
    conn.commit()


def _archived_seqs(dsn: str, schema: str) -> list[int]:
    """The ``seq`` of each archived event that has one, in archive order."""
    archived = _rows(
        dsn,
        f'SELECT payload FROM "{schema}".delivered'
        " WHERE convert_from(payload, 'UTF8')::jsonb ? 'seq' ORDER BY id",
    )
    return [json.loads(bytes(p))["seq"] for (p,) in archived]


def test_a_wal_batch_whose_archive_waits_on_a_lock_holds_up_its_outbox_only(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """A WAL batch's finish runs off the loop: while its archive waits on a lock, a table outbox
    of the same relay keeps flowing. The WAL batch read after it is sent but not committed
    before it (each commits the position it reaches): once the lock goes, both are archived, in
    the order read, and the position is past both."""
    other = f"t_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        migrate(conn, other)
    try:
        boxes = [Outbox(wal_schema, wal_dsn, wal_schema), Outbox(other, wal_dsn, other)]
        config = RelayConfig(wal_dsn, poll_interval=0.1)
        with running_relay(config, bootstrap=kafka, outboxes=boxes):
            first = _one_delivered(wal_dsn, wal_schema, topic)
            with _archive_locked(wal_dsn, wal_schema) as locker:
                with psycopg.connect(wal_dsn) as conn:
                    _two_batches_behind_the_lock(conn, wal_dsn, wal_schema, topic)
                    for n in range(20):
                        outbox.enqueue(conn, topic, {"n": n}, key=f"k{n % 4}", schema=other)
                        conn.commit()
                wait_for(
                    lambda: count(wal_dsn, other, "delivered") == 20, timeout=20, what="the table outbox"
                )
                # Neither WAL batch committed (the archive itself is locked: its position is read).
                assert _rows(wal_dsn, _LSN.format(_position(wal_schema))) == first
                locker.rollback()
            wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 3, what="the WAL batches, unlocked")
            after = _rows(wal_dsn, _LSN.format(_position(wal_schema)))
            assert after[0][0] > first[0][0]
        assert _archived_seqs(wal_dsn, wal_schema) == [0, 1]
    finally:
        with psycopg.connect(wal_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(other)))


def test_a_wal_batch_waiting_behind_one_that_fails_is_not_committed_and_both_are_read_again(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """A WAL batch complete while the one read before it is still finishing goes to a finisher
    at once, to wait there and commit only after that one. If that one fails (here its session
    is killed while its archive waits on a lock), the later one gives up unwritten: committed,
    its position would have a restart skip the failed one's events. Both are read again from
    the slot and archived once each, in the order read."""
    config = RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1)
    with running_relay(config, bootstrap=kafka) as relay:
        first = _one_delivered(wal_dsn, wal_schema, topic)
        with _archive_locked(wal_dsn, wal_schema) as locker:
            with psycopg.connect(wal_dsn) as conn:
                _two_batches_behind_the_lock(conn, wal_dsn, wal_schema, topic)
            # The second batch, acked, is on a finisher too, waiting for the first.
            wait_for(lambda: len(relay.finisher.finishing) == 2, what="the second batch handed over")
            with psycopg.connect(wal_dsn, autocommit=True) as admin:
                admin.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE wait_event_type = 'Lock' AND query LIKE %s",
                    (f'%"{wal_schema}".delivered%',),
                )
            # The second batch's finisher gave up when the first one's finish returned, before the
            # loop took that result. (Read again, both come back to a finish that waits on the lock
            # until it goes: nothing is left finishing only once the lock goes.)
            wait_for(lambda: relay.stats.leases_lost == 1, what="the first batch's failure")
            assert _rows(wal_dsn, _LSN.format(_position(wal_schema))) == first
            locker.rollback()
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 3, what="both read again and archived")
        assert _rows(wal_dsn, _LSN.format(_position(wal_schema)))[0][0] > first[0][0]
    assert _archived_seqs(wal_dsn, wal_schema) == [0, 1]
    assert relay.stats.leases_lost == 1


def test_transactions_read_from_the_wal_do_not_make_the_relay_claim_its_empty_table(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """The table is claimed in WAL capture when it has news (a NOTIFY: a delayed or held event
    went in) or on its poll timer, not because the reader woke the loop: that made every other
    WAL batch wait for an empty claim of the table, a round trip in each event's latency."""
    config = RelayConfig(wal_dsn, schema=wal_schema, poll_interval=5.0)
    with running_relay(config, bootstrap=kafka) as relay:
        wait_for(lambda: relay.ready()[0], timeout=30, what="ready")
        lane = relay.lanes["default"]
        wait_for(lambda: lane.wal is not None and lane.wal.caught_up, timeout=30, what="the reader caught up")
        table_claims = [0]
        claim = lane.ordering.claim

        def counted(conn: Any, limit: int, *topics: Any) -> list[tuple[Any, ...]]:
            table_claims[0] += 1
            return claim(conn, limit, *topics)

        lane.ordering.claim = counted  # type: ignore[method-assign]
        batches = relay.stats.claims
        with psycopg.connect(wal_dsn) as conn:
            for i in range(60):  # one transaction at a time, each read and sent on its own
                outbox.enqueue(conn, topic, {"seq": i}, key=f"k{i}", schema=wal_schema)
                conn.commit()
                time.sleep(0.02)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 60, timeout=30, what="delivered")
        wal_batches = relay.stats.claims - batches - table_claims[0]
        assert wal_batches >= 20, wal_batches  # the case in point: many batches of few events
        # The poll timer (5 s, jittered) allows a claim or two in these ~2 s; a claim per WAL
        # wake-up made about one per two batches.
        assert table_claims[0] <= 3, (table_claims[0], wal_batches)


def test_a_slot_that_does_not_advance_turns_readyz_not_ready_and_back(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """A sink that takes events and never answers (a frozen network, a hung broker) stops the
    relay confirming the slot: transactions read wait behind the batches in flight, and WAL
    piles up. /readyz says so by name once one has waited the stall timeout, and is ready again
    when the sink answers; nothing is lost."""
    sink = _Gated(kafka)
    sink.closed = {"G"}
    config = RelayConfig(
        wal_dsn, schema=wal_schema, poll_interval=0.05, max_batches_in_flight=1, stall_timeout=2
    )

    def emit(seq: int) -> None:
        with psycopg.connect(wal_dsn) as conn:
            outbox.enqueue(conn, topic, {"seq": seq, "gate": "G"}, key="K", schema=wal_schema)
            conn.commit()

    with running_relay(config, lambda: sink) as relay:
        wait_for(lambda: relay.ready()[0], timeout=30, what="ready")
        emit(0)
        wait_for(lambda: "G" in sink.waiting, timeout=30, what="the first batch in flight, unanswered")
        emit(1)  # read, and waits: the one batch allowed is out
        said: list[str] = []

        def slot_named() -> bool:
            ready, why = relay.ready()
            said.append(why)
            return not ready and "the WAL slot does not advance: a transaction read" in why

        try:
            wait_for(slot_named, timeout=30, what="not ready, naming the slot")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; /readyz said last: {said[-1:]}") from None
        sink.open("G")
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 2, timeout=30, what="both delivered")
        wait_for(lambda: relay.ready()[0], timeout=30, what="ready again")


@pytest.mark.slow  # processes, or a server of its own: the matrices leave it out
def test_a_database_restart_does_not_wait_on_the_reader_s_events_in_flight(kafka: str, topic: str) -> None:
    """A server shutting down waits for each walsender until its reader confirms what it was sent
    (or wal_sender_timeout, 60 s). The reader cannot confirm a WAL batch still in flight, and the
    relay could not hand it on while the database was down: the restart stood still for a minute
    (CI: the fault harness's pg-restart row in WAL capture, pg_ctl gave up). The relay now lets
    go of the WAL when it cannot reach the database, and reads it again once the server is back."""
    from tests.pgserver import Server

    server = Server("18").start()
    schema = "outbox"
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            migrate(conn, schema)
            capture.switch(conn, schema, "wal")
        sink = _Gated(kafka)
        sink.closed = {"X"}
        config = RelayConfig(server.dsn, schema=schema, poll_interval=0.05)
        with running_relay(config, lambda: sink):
            with psycopg.connect(server.dsn) as conn:
                outbox.enqueue(conn, topic, {"k": "K", "seq": 0, "gate": "X"}, key="K", schema=schema)
                conn.commit()
            wait_for(lambda: "X" in sink.waiting, timeout=30, what="the WAL batch in flight")
            started = time.monotonic()
            status = server.stop(wait=20)
            took = time.monotonic() - started
            assert status == 0, f"PostgreSQL still shutting down after {took:.0f} s: the reader held it"
            server.start()
            sink.open("X")
            wait_for(lambda: count(server.dsn, schema, "delivered") == 1, timeout=60, what="delivered after")
        assert _rows(server.dsn, f'SELECT count(*) FROM "{schema}".delivered') == [(1,)]
        assert len(first_occurrences(read_topic(kafka, topic, 1))) == 1
    finally:
        server.remove()


def _reader(relays: list[RelayProcess]) -> RelayProcess | None:
    """The relay that streams the slot: it said it reads the slot, and not (since) that it stands by."""
    for r in relays:
        out = r.output()
        if r.proc.poll() is None and "reading events from the WAL slot" in out:
            standby = out.rfind("standing by")
            if standby < 0 or out.rfind("taking over the WAL slot") > standby:
                return r
    return None


@pytest.mark.slow  # processes, or a server of its own: the matrices leave it out
def test_sigkilled_readers_are_taken_over_by_the_standby_and_nothing_is_lost(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """Two relays: one reads the slot, one stands by. The reader is SIGKILLed under load and the
    other takes over; a third joins and the new reader is SIGKILLed too. Every committed event
    arrives, per-key order holds, and nothing is archived twice (capture.lsn, committed with
    the archive, skips what the slot sends again)."""
    stop = threading.Event()
    committed: list[int] = []

    def write() -> None:
        seq = 0
        with psycopg.connect(wal_dsn) as conn:
            while not stop.is_set():
                for k in range(10):
                    outbox.enqueue(conn, topic, {"k": f"k{k}", "seq": seq}, key=f"k{k}", schema=wal_schema)
                conn.commit()
                committed.append(seq)
                seq += 1
                time.sleep(0.005)

    args = ("--poll-interval", "0.2", "--metrics-port", "0")
    relays = [RelayProcess(wal_dsn, wal_schema, kafka, *args) for _ in range(2)]
    writer = threading.Thread(target=write, daemon=True)
    try:
        writer.start()
        for _ in range(2):
            first = wait_for(lambda: _reader(relays), timeout=60, what="a relay reading the slot")
            wait_for(lambda: count(wal_dsn, wal_schema, "delivered") > 200 * len(relays), timeout=60)
            first.proc.kill()
            first.proc.wait()
            wait_for(
                lambda f=first: (r := _reader(relays)) is not None and r is not f, timeout=30, what="takeover"
            )
            relays.append(RelayProcess(wal_dsn, wal_schema, kafka, *args))
        time.sleep(1)
        stop.set()
        writer.join()
        total = 10 * len(committed)
        wait_for(
            lambda: count(wal_dsn, wal_schema, "delivered") >= total, timeout=60, what="every event archived"
        )
    finally:
        stop.set()
        for r in relays:
            r.close()
    messages = read_topic(kafka, topic, total)
    assert {m.event_id for m in messages} == set(
        r[0] for r in _rows(wal_dsn, f'SELECT event_id::text FROM "{wal_schema}".delivered')
    )
    assert len(first_occurrences(messages)) == total  # nothing lost
    assert_per_key_order(messages)
    assert _rows(wal_dsn, f'SELECT count(*) - count(DISTINCT event_id) FROM "{wal_schema}".delivered') == [
        (0,)
    ]
    assert count(wal_dsn, wal_schema, "events") == 0


def test_a_large_transaction_goes_in_pieces_and_a_relay_killed_inside_it_resumes_there(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """One transaction of 20,000 events is handed on in pieces, each committing its position inside
    the transaction (capture.part_commit, part_events). A relay SIGKILLed in the middle of it is
    replaced by one that resumes at that event: nothing lost, nothing archived twice, and what
    reaches Kafka twice is bounded by what was in flight."""
    total = 20_000
    with psycopg.connect(wal_dsn) as conn:
        events = [{"topic": topic, "payload": {"k": f"k{i % 10}", "seq": i // 10}, "key": f"k{i % 10}"}
                  for i in range(total)]  # fmt: skip
        outbox.enqueue_many(conn, events, schema=wal_schema)
        conn.commit()
    args = ("--batch-size", "500", "--metrics-port", "0")
    first = RelayProcess(wal_dsn, wal_schema, kafka, *args)
    try:
        wait_for(
            lambda: count(wal_dsn, wal_schema, "delivered") >= 2_000, timeout=60, what="pieces handed on"
        )
        first.proc.kill()
        first.proc.wait()
        first_log = first.output()
    finally:
        first.close()
    # Handed on: archived, put into the table for a retry (a send that timed out, under load),
    # or dead-lettered (none should be: the tail of the relay's log says why if one is). Read in
    # one statement, one snapshot: the killed relay's last commit may still land on the server
    # after its process is gone (all its messages were sent), and counts read one by one could
    # straddle it (seen: position 5,000 read after the commit, 4,000 archived read before it).
    done, events_left, dead, has_part, part_events = _rows(
        wal_dsn,
        f'SELECT (SELECT count(*) FROM "{wal_schema}".delivered), (SELECT count(*) FROM "{wal_schema}".events),'
        f' (SELECT count(*) FROM "{wal_schema}".dead_letters), part_commit IS NOT NULL, part_events'
        f" FROM {_position(wal_schema)} AS p",
    )[0]
    handed = done + events_left + dead
    part = (has_part, part_events)
    assert handed < total, "the relay finished before the kill: the test proves nothing"
    assert part == (True, handed) and dead == 0, (
        f"capture says {part} with {done} archived, {dead} dead, {handed} handed on; "
        f"the relay's log ends: {first_log[-3000:]}"
    )
    second = RelayProcess(wal_dsn, wal_schema, kafka, *args)
    try:
        # The rest, and the transaction's end: its commit comes as a piece of its own (empty when
        # the events filled whole pieces), which may be handed on just after the last events.
        wait_for(
            lambda: (
                count(wal_dsn, wal_schema, "delivered") >= total
                and _rows(wal_dsn, f"SELECT part_commit FROM {_position(wal_schema)} AS p") == [(None,)]
            ),
            timeout=120,
            what="the rest, and the transaction's end",
        )
    finally:
        second.close()
    assert _rows(wal_dsn, f'SELECT count(*), count(DISTINCT event_id) FROM "{wal_schema}".delivered') == [
        (total, total)
    ]
    assert _rows(wal_dsn, f"SELECT part_commit FROM {_position(wal_schema)} AS p") == [(None,)]  # the end
    messages = read_topic(kafka, topic, total)
    assert len(first_occurrences(messages)) == total
    assert len(messages) - total <= 10_000, "more sent twice than a relay has in flight"
    assert_per_key_order(messages)


def _position(schema: str) -> str:
    """The handed-on position (lsn, part_commit, part_events) as a subquery: the greatest row of
    capture_positions, as the relay reads it (capture.sql, capture_state)."""
    return (
        f'(SELECT lsn, part_commit, part_events FROM "{schema}".capture_positions'
        " ORDER BY coalesce(part_commit, lsn, '0/0'::pg_lsn) DESC,"
        " CASE WHEN part_commit IS NULL THEN 0 ELSE part_events END DESC LIMIT 1)"
    )


def _rows(dsn: str, statement: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(statement).fetchall()  # type: ignore[arg-type]


def test_wal_capture_is_refused_in_one_line_unless_wal_level_is_logical(pg_dsn: str, schema: str) -> None:
    from tests.conftest import _wal_level
    from tests.pgserver import Server

    server = None
    dsn = pg_dsn
    if _wal_level(pg_dsn)[0] == "logical":  # the matrix's servers: one of its own, at replica
        server = Server("18", wal_level="replica").start()
        dsn = server.dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            migrate(conn, schema)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "outbox", "migrate", "--dsn", dsn, "--schema", schema, "--capture", "wal"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    finally:
        if server is not None:
            server.remove()
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "wal_level is replica, not logical" in out.stderr, out.stderr
    assert "ALTER SYSTEM SET wal_level = logical" in out.stderr
    with pytest.raises(ConfigError, match="--capture: expected one of table, wal"):
        capture.switch(None, schema, "disk")  # type: ignore[arg-type]


def test_the_slot_s_lag_and_activity_are_metrics(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """outbox_wal_slot_lag_bytes / _lag_seconds / _active: WAL kept while no relay reads grows
    and is not confirmed; a relay reading the slot makes it active and confirms it."""
    from outbox.relay.gauges import DatabaseGauges
    from outbox.relay.metrics import RelayMetrics
    from outbox.store.outboxes import Outbox

    metrics = RelayMetrics()
    gauges = DatabaseGauges(wal_dsn, lambda: [Outbox("orders", wal_dsn, wal_schema)], metrics)

    def scrape() -> dict[str, float]:
        gauges._read_at = 0.0  # read again now, whatever the TTL
        assert gauges.refresh()
        return {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for gauge in (metrics.wal_lag_bytes, metrics.wal_lag_seconds, metrics.wal_active)
            for line in gauge.render()
            if 'outbox="orders"' in line
        }

    _write_keyed(wal_dsn, wal_schema, topic, ["a"], 50)
    first = scrape()
    assert first["outbox_wal_slot_active"] == 0 and first["outbox_wal_slot_lag_bytes"] > 0, first
    time.sleep(1.1)
    assert scrape()["outbox_wal_slot_lag_seconds"] >= 1.0  # not confirmed, and not moving
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 50, timeout=30, what="delivered")
        wait_for(lambda: scrape()["outbox_wal_slot_active"] == 1, timeout=10, what="the slot active")
        wait_for(lambda: scrape()["outbox_wal_slot_lag_seconds"] < 1.0, timeout=10, what="the slot confirmed")


def test_status_shows_the_capture_mode_and_the_slot(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    def status() -> tuple[str, dict[str, Any]]:
        args = [sys.executable, "-m", "outbox", "status", "--dsn", wal_dsn, "--schema", wal_schema]
        text = subprocess.run(args, capture_output=True, text=True, timeout=60, check=True).stdout
        report = json.loads(
            subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=60).stdout
        )
        return text, report["capture"]

    _write_keyed(wal_dsn, wal_schema, topic, ["a"], 20)
    text, report = status()
    slot = recorded_slot(wal_dsn, wal_schema)
    assert f"capture              wal, slot {slot} NOT read by any relay" in text, text
    assert report["mode"] == "wal" and report["slot_active"] is False and report["slot_lag_bytes"] > 0
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 20, timeout=30, what="delivered")
        text, report = status()
        assert f"wal, slot {slot} read by a relay" in text and report["slot_active"] is True, text
    with psycopg.connect(wal_dsn) as conn:
        version = conn.info.server_version
        failover = conn.execute("SELECT * FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        columns = [
            c.name for c in conn.execute("SELECT * FROM pg_replication_slots LIMIT 0").description or []
        ]
    if version >= 170000:  # a failover slot, which standbys set up for it keep in step
        assert failover is not None and failover[columns.index("failover")] is True


def _switch(dsn: str, schema: str, mode: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        capture.switch(conn, schema, mode)


def test_switching_to_wal_with_rows_pending_loses_nothing_and_keeps_each_key_s_order(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """Rows written in table capture, then events in WAL capture, no relay running: the WAL events
    of a key with rows pending follow them into the table, in order."""
    _switch(wal_dsn, wal_schema, "table")  # the slot is kept
    _write_keyed(wal_dsn, wal_schema, topic, ["a", "b"], 5)  # a new connection: table capture
    assert count(wal_dsn, wal_schema, "events") == 10
    _switch(wal_dsn, wal_schema, "wal")
    _write_keyed(wal_dsn, wal_schema, topic, ["a", "b", "c"], 5, start=5)  # WAL capture
    assert count(wal_dsn, wal_schema, "events") == 10
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 25, timeout=30, what="all 25")
    messages = read_topic(kafka, topic, 25)
    assert len(first_occurrences(messages)) == 25
    assert_per_key_order(messages)
    assert count(wal_dsn, wal_schema, "events") == 0


def test_switching_back_to_table_with_wal_events_pending_loses_nothing_and_keeps_each_key_s_order(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """Events in WAL capture, then rows in table capture after switching back, no relay running:
    the relay reads the slot before it claims the rows written since (the slot holds the older
    events), and the kept slot's events are all delivered."""
    _write_keyed(wal_dsn, wal_schema, topic, ["a", "b"], 5)  # WAL capture
    _switch(wal_dsn, wal_schema, "table")
    _write_keyed(wal_dsn, wal_schema, topic, ["a", "b", "c"], 5, start=5)  # table capture
    assert count(wal_dsn, wal_schema, "events") == 15
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 25, timeout=30, what="all 25")
    messages = read_topic(kafka, topic, 25)
    assert len(first_occurrences(messages)) == 25
    assert_per_key_order(messages)
    slot = recorded_slot(wal_dsn, wal_schema)
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        assert "slot" in capture.switch(conn, wal_schema, "table", drop_slot=True)
        assert capture.state(conn, wal_schema).slot is None
        assert (
            conn.execute("SELECT 1 FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
            is None
        )


# The relay's own logic, the same on every server: the version matrix leaves it out (slow).
@pytest.mark.slow
def test_a_relay_whose_first_look_at_the_capture_fails_claims_no_row_until_a_look_succeeds(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """The switch back to table capture (the slot's events older than the table's rows) with the
    relay's first look at the capture failing: its statement outlives the relay's statement
    timeout behind a lock. The relay claims nothing of the table until a look succeeds, then
    reads the slot first. It had taken the outbox for table capture until a look 10 s later,
    and sent the table's rows of keys a and b ahead of their older events in the slot."""
    _write_keyed(wal_dsn, wal_schema, topic, ["a", "b"], 5)  # WAL capture
    _switch(wal_dsn, wal_schema, "table")
    _write_keyed(wal_dsn, wal_schema, topic, ["a", "b", "c"], 5, start=5)  # table capture
    config = RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1, lease=2.0, delivery_timeout=1.0)
    with psycopg.connect(wal_dsn) as blocker:
        blocker.execute(
            sql.SQL("LOCK TABLE {}.capture IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(wal_schema))
        )
        with running_relay(config, bootstrap=kafka) as relay:
            wait_for(lambda: relay.sessions.database.episodes, timeout=30, what="the capture look to fail")
            time.sleep(0.5)  # the old relay claimed its table at once
            assert count(wal_dsn, wal_schema, "delivered") == 0, "rows claimed before the capture was known"
            blocker.rollback()  # the lock goes: the next look succeeds
            wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 25, timeout=30, what="all 25")
    messages = read_topic(kafka, topic, 25)
    assert len(first_occurrences(messages)) == 25
    assert_per_key_order(messages)


@pytest.mark.slow  # processes, or a server of its own: the matrices leave it out
def test_the_demo_runs_in_wal_capture(wal_dsn: str, wal_schema: str, kafka: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "outbox", "demo", "--dsn", wal_dsn, "--kafka-bootstrap", kafka,
         "--schema", wal_schema, "--capture", "wal", "--seconds", "3", "--rate", "200"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("demo summary: "))
    summary = json.loads(line.removeprefix("demo summary: "))
    # One transaction in ten of each writer is rolled back on purpose. The demo's pace is the
    # machine's, not what is checked: 3 s at 200/s beside the matrices' eight suites committed 96,
    # and the fault suite's writer once fell to a twentieth of its rate, so no count is asserted.
    assert summary["rolled_back"] > 0 and summary["committed"] >= 9 * summary["rolled_back"]
    assert summary["missing"] == 0 and summary["rolled_back_but_consumed"] == 0
    assert count(wal_dsn, wal_schema, "events") == 0  # the orders' events never touched the table
    with psycopg.connect(wal_dsn) as conn:
        assert capture.state(conn, wal_schema).mode == "wal"


def test_a_slot_that_cannot_be_read_makes_readyz_say_so(wal_dsn: str, wal_schema: str, kafka: str) -> None:
    """The slot dropped under a running relay (an operator, max_slot_wal_keep_size): the relay is
    not ready, and says which outbox and why; `outbox status` says the slot is missing."""
    slot = recorded_slot(wal_dsn, wal_schema)
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka) as relay:
        wait_for(lambda: relay.ready()[0], timeout=30, what="ready")
        lane = relay.lanes["default"]
        wait_for(lambda: lane.wal is not None and lane.wal.reading, timeout=30, what="the reader streaming")

        def drop() -> bool:  # end the reader's session, and drop the slot before it is back
            with psycopg.connect(wal_dsn, autocommit=True) as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s AND active",
                    (slot,),
                )
                try:
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                except psycopg.errors.ObjectInUse:
                    return False
                return True

        wait_for(drop, timeout=30, what="the slot dropped")
        wait_for(lambda: "does not exist" in relay.ready()[1], timeout=30, what="not ready: the slot is gone")
        ready, why = relay.ready()
        assert not ready and "outbox default: reading its WAL slot" in why and slot in why, why
        # A fleet over that relay says so too: it called the outbox ready while its reader failed.
        fleet = Fleet(relay.config, lambda: KafkaSink(kafka), lambda: None)
        fleet.relays[relay.outboxes[0].database] = relay
        fleet.running.set()
        ready, why = fleet.ready()
        assert not ready and "outbox default: not served: reading its WAL slot" in why, why
    out = subprocess.run(
        [sys.executable, "-m", "outbox", "status", "--dsn", wal_dsn, "--schema", wal_schema],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert f"slot {slot} MISSING" in out.stdout, out.stdout


# The relay's own logic, the same on every server: the version matrix leaves it out (slow).
@pytest.mark.slow
def test_a_relay_started_after_the_slot_was_lost_says_so_and_never_reads_the_table_for_it(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The slot gone before the relay starts (a failover to a standby that did not synchronise
    it, then a relay's restart; or dropped by hand). The relay's first look at the database's
    slots found none, took the outbox for table capture and said "ready" while the writers'
    events went to a WAL nobody read (the failover test, when the crash came before the relay's
    first claim). The outbox's publication is still there: its reader looks, and says the slot
    is lost, in one line, and /readyz names it."""
    import logging

    caplog.set_level(logging.INFO, logger="outbox")
    slot = recorded_slot(wal_dsn, wal_schema)
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
    with psycopg.connect(wal_dsn) as conn:
        outbox.enqueue(conn, topic, b"emitted with no slot to keep it", schema=wal_schema)
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka) as relay:
        wait_for(lambda: relay.running.is_set(), timeout=30, what="running")
        wait_for(lambda: "is lost" in relay.ready()[1], timeout=15, what="not ready: the slot is lost")
        time.sleep(1)  # a few more looks: it stays so, and says it once
        ready, why = relay.ready()
        lane = relay.lanes["default"]
        assert lane.wal is not None and lane.upkept.capture_mode == "wal"
    assert not ready and f"outbox default: reading its WAL slot: the WAL slot {slot} is lost" in why, why
    lost = [r.getMessage() for r in caplog.records if f"the WAL slot {slot} is lost" in r.getMessage()]
    assert len(lost) == 1 and "delivered: every event committed up to WAL position" in lost[0], lost


def test_a_reader_that_fails_unexpectedly_says_so_once_and_reads_on(
    wal_dsn: str, wal_schema: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    """An error the reader does not expect (here the loop's wake raises, as a bug would) ended
    its thread: its condition stayed as it was, so /readyz said ready while nothing was read.
    It is a failure like a lost connection now: one line with the traceback, the condition
    failed, and the reader reads again (the slot sends the transaction again)."""
    import logging

    from outbox.capture.wal_reader import WalReader

    caplog.set_level(logging.ERROR, logger="outbox.capture")
    wakes: list[float] = []

    def wake() -> None:
        wakes.append(time.monotonic())
        if len(wakes) == 1:
            raise RuntimeError("a bug in the loop's wake")

    with psycopg.connect(wal_dsn) as conn:
        found = capture.state(conn, wal_schema)
    reader = WalReader(wal_dsn, wal_schema, found, wake)
    reader.start()
    try:
        with psycopg.connect(wal_dsn) as conn:
            outbox.enqueue(conn, topic, b"read twice", schema=wal_schema)
        wait_for(lambda: len(wakes) >= 2, timeout=30, what="the transaction read again")
        assert reader.is_alive() and reader.condition.episodes == 1, reader.condition.last_error
        assert "the reader failed: RuntimeError: a bug in the loop's wake" in reader.condition.last_error
        assert reader.queued == 1  # read again once, from the position handed on
    finally:
        reader.stop()
        reader.join(10)
    said = [r for r in caplog.records if "the WAL reader failed unexpectedly" in r.getMessage()]
    assert len(said) == 1 and "Traceback" in said[0].detail, [r.getMessage() for r in caplog.records]  # type: ignore[attr-defined]


def test_an_idle_outbox_s_slot_moves_past_traffic_that_is_not_its_own(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """The outbox delivers some events, then writes nothing while the app goes on writing its own
    tables: the slot is confirmed past that WAL (read whole, none of it ours), so an idle outbox
    does not pin the server's WAL. Two things report it: the reader's idle report (wal_end once
    nothing is queued or in flight) and psycopg2, which moves the flush position to a
    keepalive's wal_end once the last message read is confirmed; without both, the slot would
    stay at the last event's transaction."""
    slot = recorded_slot(wal_dsn, wal_schema)

    def confirmed() -> int:
        with psycopg.connect(wal_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')::bigint FROM pg_replication_slots"
                " WHERE slot_name = %s",
                (slot,),
            ).fetchone()
        assert row is not None
        return int(row[0])

    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka) as relay:
        wait_for(lambda: relay.ready()[0], timeout=30, what="ready")
        lane = relay.lanes["default"]
        wait_for(lambda: lane.wal is not None and lane.wal.caught_up, timeout=30, what="the reader caught up")
        _write_keyed(wal_dsn, wal_schema, topic, ["a", "b"], 10)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 20, timeout=30, what="delivered")
        start = confirmed()  # before the app's traffic (read after it, it may be confirmed already)
        with psycopg.connect(wal_dsn, autocommit=True) as conn:  # an app's own tables, no event
            other = sql.Identifier(f"{wal_schema}_app")
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(other))
            try:
                conn.execute(sql.SQL("CREATE TABLE {}.orders (id bigint, note text)").format(other))
                for _ in range(5):
                    conn.execute(
                        sql.SQL(
                            "INSERT INTO {}.orders SELECT g, repeat(%s, 50) FROM generate_series(1, 2000) g"
                        ).format(other),
                        ("x",),
                    )
                row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetchone()
                assert row is not None
                written = int(row[0])
                assert start < written
                wait_for(
                    lambda: confirmed() >= written, timeout=30, what="the slot confirmed past the app's WAL"
                )
            finally:
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(other))
    assert count(wal_dsn, wal_schema, "delivered") == 20


def test_the_position_written_per_wal_batch_reads_a_few_pages_under_a_held_snapshot(
    pg_dsn: str, schema: str
) -> None:
    """Every WAL batch commits its position. Kept in one row (migration 0013), each update left a
    dead row version that a snapshot held open keeps, and every later update read them all (148
    heap pages after 20,000 batches, 1.13 ms an update, 0.37 at first), and the relay's commit ->
    ack p50 grew from 1.7 to 5.3 ms in the 10-minute held-snapshot bench. Appended, with the
    superseded rows deleted among the last few, the statements read a few pages however many
    batches went before, and the position read back is the last one written."""
    from outbox.store.queries import query

    holder = psycopg.connect(pg_dsn)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")  # nothing deleted or updated after this can be removed

    def position(n: int) -> dict[str, Any]:
        return {"lsn": capture.lsn_text(0x1_0000_0000 + n * 0x100), "part_commit": None, "part_events": 0}

    def buffers(conn: psycopg.Connection[Any], name: str, params: dict[str, Any] | None) -> int:
        """Shared buffers the statement touched (hit + read), run and rolled back: the least of
        three runs. What a session does once is not what this measures: on PostgreSQL 14, beside
        the matrix's other tests (which make and drop schemas all along, and autovacuum), a first
        run of the INSERT once touched 35 buffers where it touches 6 to 9 alone, and other
        sessions' DDL made a first run cost more here too (its catalog caches rebuilt inside the
        statement). The cost this guards against, every statement reading the dead versions a
        held snapshot keeps (108 to 148 buffers), is in every run."""
        runs = []
        for _ in range(3):
            plan = conn.execute(
                sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) ") + query(name, schema),
                params,
            ).fetchone()
            conn.rollback()
            assert plan is not None
            top = plan[0][0]["Plan"]
            runs.append(int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"]))
        return min(runs)

    try:
        with psycopg.connect(pg_dsn) as conn:
            for start in range(1, 10_001, 500):  # as the relay sends them: pipelined
                with conn.pipeline():
                    for n in range(start, start + 500):
                        conn.execute(query("wal_positions_superseded", schema), position(n))
                        conn.execute(query("wal_handed_on", schema), position(n))
                        conn.commit()
            heap = conn.execute(
                "SELECT pg_relation_size(%s::regclass) / 8192", (f'"{schema}".capture_positions',)
            ).fetchone()
            conn.commit()
            assert heap is not None and heap[0] > 50, "the dead row versions were removed: nothing held"
            # Statistics as autovacuum leaves them (a table of one or two rows): the planner took
            # the position index for the DELETE, and walked every dead entry below the position.
            conn.execute(sql.SQL("ANALYZE {}.capture_positions").format(sql.Identifier(schema)))
            conn.commit()
            costs = {
                "superseded": buffers(conn, "wal_positions_superseded", position(10_001)),
                "handed_on": buffers(conn, "wal_handed_on", position(10_001)),
                "state": buffers(conn, "capture_state", None),
            }
            assert max(costs.values()) <= 20, (costs, f"{heap[0]} heap pages")
            live = conn.execute(f'SELECT count(*) FROM "{schema}".capture_positions').fetchone()
            assert live == (2,) or live == (1,), live
            found = capture.state(conn, schema)
            assert (found.lsn, found.part_commit) == (position(10_000)["lsn"], None)
    finally:
        holder.close()


def test_an_outbox_at_0013_keeps_its_handed_on_position_through_0014(pg_dsn: str) -> None:
    """The position an outbox in WAL capture had in capture's row (0013) still counts after 0014,
    until a new relay's appended position passes it."""
    from outbox.store.migrate import _preamble, _record, migrations

    name = f"m_{uuid.uuid4().hex[:10]}"
    every = migrations()
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            with conn.transaction():  # an outbox migrated by the release that ended at 0013
                conn.execute(_preamble(name))
                for m in every:
                    if m.version <= 13:
                        conn.execute(m.render(name))
                        conn.execute(_record(name, m))
            conn.execute(
                sql.SQL("UPDATE {}.capture SET lsn = '2/A0', part_commit = '2/F0', part_events = 7").format(
                    sql.Identifier(name)
                )
            )
            assert [m.version for m in migrate(conn, name)] == [m.version for m in every if m.version > 13]
            found = capture.state(conn, name)
            assert (found.lsn, found.part_commit, found.part_events) == ("2/A0", "2/F0", 7)
            # A new relay's batches: the greater position counts, wherever it is kept (an old
            # relay may still update capture's row during a rolling upgrade).
            from outbox.store.queries import query

            for lsn, expected in (("2/B0", ("2/A0", "2/F0", 7)), ("3/0", ("3/0", None, 0))):
                position = {"lsn": lsn, "part_commit": None, "part_events": 0}
                with conn.transaction():
                    conn.execute(query("wal_positions_superseded", name), position)
                    conn.execute(query("wal_handed_on", name), position)
                found = capture.state(conn, name)
                assert (found.lsn, found.part_commit, found.part_events) == expected, lsn
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def _keys(dsn: str, schema: str) -> list[bytes]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT key FROM {}.capture_keys ORDER BY id").format(sql.Identifier(schema))
        ).fetchall()
    return [bytes(k) for (k,) in rows]


def _window_ended(dsn: str, schema: str, key: bytes) -> None:
    """As if ``key``'s window of a minute had ended now (the test cannot wait a minute), and a
    second (KEY_DROP_MARGIN) had passed since: what committed until now is within it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("UPDATE {}.capture_keys SET retire_at = clock_timestamp() WHERE key = %s").format(
                sql.Identifier(schema)
            ),
            (key,),
        )
    time.sleep(capture.mode.KEY_DROP_MARGIN + 0.1)


def _slot_caught_up(dsn: str, schema: str) -> Callable[[], bool]:
    """A condition: the slot is confirmed past where the WAL ends now (everything written so far,
    ours included). A fixed mark: beside other tests on the server the WAL's end moves on, and a
    slot that must reach wherever it is now never does."""
    with psycopg.connect(dsn) as conn:
        mark = conn.execute("SELECT pg_current_wal_insert_lsn()").fetchone()[0]  # type: ignore[index]
        slot = capture.state(conn, schema).slot

    def past() -> bool:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
                (mark, slot),
            ).fetchone()
        return bool(row and row[0])

    return past


def test_a_rotated_key_signs_from_the_rotation_and_the_old_one_only_within_its_window(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """``outbox capture rotate-key``: the running relay's reader reads the keys again at the
    rotation's message (no restart), the new key's events are delivered, and a message signed
    with the old key is delivered only if it commits within the window: after it, a leaked key
    signs nothing that is delivered. A later rotation drops a key once the slot is past every
    message it could have signed. A window under a minute is refused (issue 70: with 0 s, a live
    reader and a restarted one judged a writer's message of the rotation's instant differently)."""
    from outbox.capture.wal_message import sign
    from outbox.cli import main

    def forge(key: bytes, n: int) -> None:
        """What a holder of ``key`` can emit: an event of its own, signed with it."""
        content = b"%f\n" % time.time() + wal_message.encode(
            encode_event(topic, {"forged": n}, key=None, headers=None)
        )
        with psycopg.connect(wal_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)",
                         (capture.prefix_of(wal_schema), sign(key, content)))  # fmt: skip

    rotate = ["capture", "rotate-key", "--dsn", wal_dsn, "--schema", wal_schema, "--yes"]
    assert main([*rotate, "--window", "0s"]) == 2 and len(_keys(wal_dsn, wal_schema)) == 1
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        with psycopg.connect(wal_dsn) as conn:
            outbox.enqueue(conn, topic, {"n": 1}, key="k", schema=wal_schema)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 1, timeout=30, what="the first event")
        (first,) = _keys(wal_dsn, wal_schema)
        assert main([*rotate, "--window", "1m"]) == 0
        forge(first, 1)  # within the window: verified, as a writer's late commit would be
        with psycopg.connect(wal_dsn) as conn:
            outbox.enqueue(conn, topic, {"n": 2}, key="k", schema=wal_schema)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 3, timeout=30, what="the window's events")
        _window_ended(wal_dsn, wal_schema, first)
        assert main([*rotate, "--window", "1h"]) == 0  # its message: the reader reads the keys again
        forge(first, 2)  # after the window: the first key leaked, and signs nothing delivered
        wait_for(
            lambda: count(wal_dsn, wal_schema, "dead_letters") == 1, timeout=30, what="the forgery refused"
        )
        second = _keys(wal_dsn, wal_schema)[1]
        forge(second, 3)  # the second's window (1 h) runs
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 4, timeout=30, what="the second's event")
        assert len(_keys(wal_dsn, wal_schema)) == 3  # the first is kept until the slot is past it
        wait_for(_slot_caught_up(wal_dsn, wal_schema), timeout=30, what="the slot confirmed")
        assert main([*rotate, "--window", "1h"]) == 0
        assert first not in _keys(wal_dsn, wal_schema) and len(_keys(wal_dsn, wal_schema)) == 3
    payloads = sorted(m.value.decode() for m in read_topic(kafka, topic, 4))
    assert payloads == ['{"forged":1}', '{"forged":3}', '{"n":1}', '{"n":2}']


# The relay's own logic, the same on every server: the version matrix leaves it out (slow).
@pytest.mark.slow
def test_a_retired_key_is_kept_while_a_lagging_slot_still_needs_it(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """A writer signs with the old key just before a rotation and commits just after it, within
    the window. The relay confirmed the rotation, then stopped: its slot lags behind the writer's
    commit. The window ends and the next rotation ran: it dropped the old key (the slot had been
    read past the rotation), and the relay, back, dead-lettered the writer's event as unsigned
    (issue 70). Now a key goes only once the slot is past every message it could have signed."""
    config = RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1)
    with running_relay(config, bootstrap=kafka):
        with psycopg.connect(wal_dsn) as conn:
            outbox.enqueue(conn, topic, {"n": 1}, schema=wal_schema)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 1, timeout=30, what="the first event")
        (first,) = _keys(wal_dsn, wal_schema)
        writer = psycopg.connect(wal_dsn)
        late = outbox.enqueue(writer, topic, {"n": "late"}, schema=wal_schema)  # signed with the first key
        with psycopg.connect(wal_dsn, autocommit=True) as conn:
            capture.rotate_key(conn, wal_schema, window=60)
        wait_for(_slot_caught_up(wal_dsn, wal_schema), timeout=30, what="the rotation confirmed")
    writer.commit()  # within the window, after the rotation; the relay is not reading
    writer.close()
    _window_ended(wal_dsn, wal_schema, first)
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        assert capture.rotate_key(conn, wal_schema, window=60).dropped == []
    assert first in _keys(wal_dsn, wal_schema)
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 2, timeout=30, what="the late event")
        assert count(wal_dsn, wal_schema, "dead_letters") == 0
        wait_for(_slot_caught_up(wal_dsn, wal_schema), timeout=30, what="the slot past it")
        with psycopg.connect(wal_dsn, autocommit=True) as conn:
            dropped = capture.rotate_key(conn, wal_schema, window=60).dropped
    assert len(dropped) == 1 and first not in _keys(wal_dsn, wal_schema)
    assert str(late) in {m.event_id for m in read_topic(kafka, topic, 2)}


# The relay's own logic, the same on every server: the version matrix leaves it out (slow).
@pytest.mark.slow
def test_outboxes_of_one_schema_name_in_two_databases_each_read_a_slot_of_their_own(
    wal_dsn: str, kafka: str, topic: str
) -> None:
    """Slots are the server's, not a database's, and were named from the schema alone: the
    second database's switch to WAL capture took the first's slot, which its relay then found in
    no database of its own, and read nothing. Now each database's is its own; a slot made by an
    earlier version keeps its name (here: the second database's), and is read."""
    from psycopg.conninfo import make_conninfo

    schema = f"w_{uuid.uuid4().hex[:10]}"
    names = [f"outbox_two_{uuid.uuid4().hex[:8]}" for _ in range(2)]
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsns = [make_conninfo(wal_dsn, dbname=name) for name in names]
    try:
        for dsn in dsns:
            with psycopg.connect(dsn, autocommit=True) as conn:
                migrate(conn, schema)
                capture.switch(conn, schema, "wal")
        first, second = (recorded_slot(dsn, schema) for dsn in dsns)
        assert first != second
        legacy = capture.slot_names(schema, names[1])[1]  # as 0.2.0 named it
        with psycopg.connect(dsns[1], autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (second,))
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (legacy,))
            conn.execute(sql.SQL("UPDATE {}.capture SET slot = %s").format(sql.Identifier(schema)), (legacy,))
        for i, dsn in enumerate(dsns):
            with psycopg.connect(dsn) as conn:
                outbox.enqueue(conn, topic, {"db": i}, key="k", schema=schema)
        outboxes = [Outbox(f"o{i}", dsn, schema) for i, dsn in enumerate(dsns)]
        relays = [running_relay(RelayConfig(dsn, schema=schema, poll_interval=0.1), bootstrap=kafka,
                                outboxes=[o]) for dsn, o in zip(dsns, outboxes, strict=True)]  # fmt: skip
        with contextlib.ExitStack() as stack:
            for relay in relays:
                stack.enter_context(relay)
            for dsn in dsns:
                wait_for(
                    lambda d=dsn: count(d, schema, "delivered") == 1, timeout=30, what="each database's event"
                )
        assert sorted(m.value for m in read_topic(kafka, topic, 2)) == [b'{"db":0}', b'{"db":1}']
    finally:
        with psycopg.connect(wal_dsn, autocommit=True) as conn:
            for name in names:
                for (slot,) in conn.execute(
                    "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (name,)
                ).fetchall():
                    conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))
