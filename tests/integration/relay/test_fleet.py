"""One relay, many outboxes of a database: each event once and in key order in every outbox,
one outbox's trouble its own, quiet outboxes served while a busy one drains."""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
from typing import Any

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.relay.relay import RelayConfig
from outbox.store.migrate import migrate
from outbox.store.outboxes import Outbox
from tests.helpers import (
    assert_per_key_order,
    count,
    owners,
    read_topic,
    running_relay,
    wait_for,
    waiting_on_a_lock,
    write_rounds,
)


def _migrated(pg_dsn: str, prefix: str, n: int) -> list[Outbox]:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for i in range(n):
            migrate(conn, f"{prefix}_{i}")
    return [Outbox(f"{prefix}_{i}", pg_dsn, f"{prefix}_{i}") for i in range(n)]


def _write(dsn: str, schema: str, topic: str, keys: int, rounds: int, first: int = 0) -> None:
    """``rounds`` transactions of one event per key; keys are the schema's own (schema-kN)."""
    write_rounds(dsn, schema, topic, keys, rounds, first, key_prefix=f"{schema}-")


def _config(pg_dsn: str, **kw: object) -> RelayConfig:
    return RelayConfig(pg_dsn, poll_interval=0.2, ownership_lease=3.0, **kw)  # type: ignore[arg-type]


def test_one_relay_serves_twenty_schemas_each_event_once_in_key_order(
    pg_dsn: str, kafka: str, topic: str, prefix: str
) -> None:
    boxes = _migrated(pg_dsn, prefix, 20)
    keys, rounds = 10, 5
    with running_relay(_config(pg_dsn), bootstrap=kafka, outboxes=boxes) as relay:
        writers = [
            threading.Thread(target=_write, args=(pg_dsn, o.schema, topic, keys, rounds)) for o in boxes
        ]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        n = len(boxes) * keys * rounds
        wait_for(
            lambda: sum(count(pg_dsn, o.schema, "delivered") for o in boxes) == n, timeout=60, what="drain"
        )
        wait_for(lambda: relay.stats.delivered == n, timeout=10, what="the relay's count")
        per_outbox = {name: lane.stats.delivered for name, lane in relay.lanes.items()}
    assert per_outbox == {o.name: keys * rounds for o in boxes}
    for o in boxes:
        assert (
            count(pg_dsn, o.schema, "delivered") == keys * rounds and count(pg_dsn, o.schema, "events") == 0
        )
    messages = read_topic(kafka, topic, n)
    assert len({m.event_id for m in messages}) == n
    assert_per_key_order(messages)


def test_a_dropped_schema_stops_only_itself_and_says_so_once(
    pg_dsn: str, kafka: str, topic: str, prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    boxes = _migrated(pg_dsn, prefix, 3)
    gone = boxes[1]
    caplog.set_level(logging.INFO)
    with running_relay(_config(pg_dsn), bootstrap=kafka, outboxes=boxes) as relay:
        _write(pg_dsn, boxes[0].schema, topic, 5, 2)
        wait_for(lambda: count(pg_dsn, boxes[0].schema, "delivered") == 10, timeout=30, what="flowing")
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(gone.schema)))
        wait_for(lambda: not relay.ready()[0], timeout=30, what="the dropped outbox seen")
        _, why = relay.ready()
        assert why.startswith("outboxes not served: 1 of 3") and f"outbox {gone.name}:" in why, why
        # The others keep flowing while it is gone.
        _write(pg_dsn, boxes[0].schema, topic, 5, 2, first=2)
        _write(pg_dsn, boxes[2].schema, topic, 5, 4)
        wait_for(lambda: count(pg_dsn, boxes[0].schema, "delivered") == 20, timeout=30, what="the first")
        wait_for(lambda: count(pg_dsn, boxes[2].schema, "delivered") == 20, timeout=30, what="the third")
        time.sleep(1.0)  # claims of the dropped one fail again meanwhile: still one line
    started = [r for r in caplog.records if getattr(r, "event", "") == "outbox.started"]
    assert len(started) == 1 and getattr(started[0], "outbox", None) == gone.name, [
        r.getMessage() for r in started
    ]
    assert "does not exist" in started[0].getMessage()
    assert_per_key_order(read_topic(kafka, topic, 40))


def test_quiet_outboxes_are_served_while_a_busy_one_drains(
    pg_dsn: str, kafka: str, topic: str, prefix: str
) -> None:
    """A backlog of 100,000 in one outbox does not starve the others: events written to quiet
    outboxes while it drains are all delivered before it is done, each within about a claim
    cycle (the strict latency target is measured by the bench, not asserted here)."""
    busy, *quiet = _migrated(pg_dsn, prefix, 4)
    with psycopg.connect(pg_dsn) as conn:
        for _ in range(50):
            outbox.enqueue_many(
                conn,
                [{"topic": topic, "key": f"busy-{i % 100}", "payload": {"k": f"busy-{i % 100}", "seq": 0}}
                 for i in range(2000)],
                schema=busy.schema,
            )  # fmt: skip
        conn.commit()
    latencies: list[float] = []
    with running_relay(_config(pg_dsn), bootstrap=kafka, outboxes=[busy, *quiet]):
        wait_for(
            lambda: count(pg_dsn, busy.schema, "delivered") > 0, timeout=30, what="the busy one starting"
        )
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for seq in range(30):  # about a second of writes to each quiet outbox, while the busy one drains
                for o in quiet:
                    with conn.transaction():
                        outbox.enqueue(conn, topic, {"k": o.name, "seq": seq}, key=o.name, schema=o.schema)
                time.sleep(0.03)
        quiet_done = time.monotonic()
        for o in quiet:
            wait_for(lambda o=o: count(pg_dsn, o.schema, "delivered") == 30, timeout=30, what=o.name)  # type: ignore[misc]
        busy_left = count(pg_dsn, busy.schema, "events")
        with psycopg.connect(pg_dsn) as conn:
            for o in quiet:
                latencies += [
                    r[0]
                    for r in conn.execute(
                        sql.SQL(
                            "SELECT extract(epoch FROM delivered_at - created_at)::float8 FROM {}.delivered"
                        ).format(sql.Identifier(o.schema))
                    ).fetchall()
                ]
        wait_for(lambda: count(pg_dsn, busy.schema, "events") == 0, timeout=120, what="the busy drain")
    assert busy_left > 0, "the busy outbox drained before the quiet ones were done: the test proves nothing"
    assert time.monotonic() - quiet_done < 60
    latencies.sort()
    p99 = latencies[int(len(latencies) * 0.99) - 1]
    assert len(latencies) == 90 and p99 < 2.0, f"quiet outboxes' p99 {p99:.3f} s while a busy one drained"


def test_a_quiet_relay_renews_every_lease_in_one_row_and_reads_its_readiness_once_a_second(
    pg_dsn: str, kafka: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet relay of many outboxes keeps its leases in all of them with one membership row,
    renewed every lease / 5 (0.4 s here), and looks at each outbox's ownership only now and then:
    it heartbeated each outbox in turn, 500 statements a second at 1,000 outboxes. The readiness
    the heartbeat records is looked at once a second at most (it reads every outbox)."""
    from outbox.relay.relay import Relay

    looks: list[float] = []
    ready = Relay.ready

    def counted(self: Relay) -> tuple[bool, str]:
        looks.append(time.monotonic())
        return ready(self)

    monkeypatch.setattr(Relay, "ready", counted)
    boxes = _migrated(pg_dsn, prefix, 20)
    config = RelayConfig(pg_dsn, poll_interval=0.2, ownership_lease=2.0)
    with running_relay(config, bootstrap=kafka, outboxes=boxes) as relay:
        wait_for(relay.running.is_set, timeout=30, what="the relay started")
        time.sleep(1.0)  # past the start
        lanes = list(relay.lanes.values())
        start, before = time.monotonic(), len(looks)
        tallies = [lane.ordering.looks for lane in lanes]
        beats = relay.membership.beats
        time.sleep(3.0)
        seconds, read = time.monotonic() - start, len(looks) - before
        outbox_looks = sum(lane.ordering.looks for lane in lanes) - sum(tallies)
        beats = relay.membership.beats - beats
        with psycopg.connect(pg_dsn) as conn:
            age = conn.execute(
                "SELECT extract(epoch FROM now() - heartbeat_at) FROM outbox_fleet.relays WHERE id = %s",
                [relay.membership.id],
            ).fetchone()
        owned = [len(owners(pg_dsn, o.schema)) for o in boxes]
    assert read <= seconds + 1, f"readiness read {read} times in {seconds:.1f} s"
    assert age is not None and float(age[0]) < config.ownership_lease, age
    assert owned == [64] * 20
    assert beats >= 5, f"{beats} membership heartbeats in {seconds:.1f} s"
    # Every 0.4 s each, as before, would be 150 looks; one look at each when another relay of
    # the database came or went (a test before this one) is 20.
    assert outbox_looks <= 40, f"{outbox_looks} looks at 20 settled outboxes in {seconds:.1f} s"


def test_a_relay_starting_over_many_outboxes_looks_at_each_once_and_creates_only_missing_partitions(
    second_db: str, kafka: str, prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At start a relay looks at each outbox's ownership once (its share taken, its next look
    spread over SETTLED_LOOK), not again within the interval: 1,000 outboxes looked at twice was
    1,000 transactions in the middle of their first drain. Their archive's day partitions are
    asked about in one statement, and only the outbox missing one gets the call that creates it.
    A database of its own: another relay's coming or going makes every outbox be looked at."""
    import outbox.relay.upkeep.partitions

    boxes = _migrated(second_db, prefix, 20)
    gap = boxes[3]
    tomorrow = f"delivered_p{(dt.datetime.now(dt.timezone.utc).date() + dt.timedelta(days=1)):%Y%m%d}"
    with psycopg.connect(second_db, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP TABLE {}.{}").format(sql.Identifier(gap.schema), sql.Identifier(tomorrow)))
    asked: list[tuple[str, str]] = []
    named = outbox.relay.upkeep.partitions.query

    def recorded(name: str, schema: str, **kw: Any) -> Any:
        asked.append((name, schema))
        return named(name, schema, **kw)

    monkeypatch.setattr(outbox.relay.upkeep.partitions, "query", recorded)
    with running_relay(_config(second_db), bootstrap=kafka, outboxes=boxes) as relay:
        wait_for(relay.running.is_set, timeout=30, what="the relay started")

        def restored() -> bool:
            with psycopg.connect(second_db) as conn:
                row = conn.execute("SELECT to_regclass(%s)", [f"{gap.schema}.{tomorrow}"]).fetchone()
            return row is not None and row[0] is not None

        wait_for(restored, timeout=10, what="the missing day partition created")
        time.sleep(2 * relay.config.ownership_lease / 5)  # two intervals: every outbox would look again
        looks = [lane.ordering.looks for lane in relay.lanes.values()]
    assert asked.count(("partitions_missing", boxes[0].schema)) == 1, asked
    assert [schema for name, schema in asked if name == "ensure_partitions"] == [gap.schema], asked
    # Each next look is at a random point of SETTLED_LOOK (120 s): a few may fall in these seconds.
    assert sum(looks) <= 25, f"{sum(looks)} looks at 20 outboxes in the seconds after the start"


def test_an_outbox_whose_archive_waits_on_a_lock_holds_up_no_other(
    pg_dsn: str, kafka: str, topic: str, prefix: str
) -> None:
    """A batch's finish (its archive, its commit) runs off the loop: while one outbox's archive
    waits on a lock (a migration, a long maintenance job), the loop goes on delivering and
    archiving the other outbox's events, and heartbeating both. When the finish ran on the loop
    itself, every outbox waited for the lock."""
    stuck, other = _migrated(pg_dsn, prefix, 2)
    with psycopg.connect(pg_dsn) as conn:
        for o in (stuck, other):
            outbox.enqueue(conn, topic, {"first": o.name}, key="k", schema=o.schema)
        conn.commit()
    with running_relay(_config(pg_dsn), bootstrap=kafka, outboxes=[stuck, other]):
        wait_for(lambda: all(count(pg_dsn, o.schema, "delivered") == 1 for o in (stuck, other)))
        with psycopg.connect(pg_dsn) as locker:
            locker.execute(
                sql.SQL("LOCK TABLE {}.delivered IN ACCESS EXCLUSIVE MODE").format(
                    sql.Identifier(stuck.schema)
                )
            )
            with psycopg.connect(pg_dsn) as conn:
                outbox.enqueue(conn, topic, {"n": 0}, key="k", schema=stuck.schema)
                conn.commit()
                # The stuck outbox's batch is sent, and its finish waits for the lock.
                wait_for(lambda: waiting_on_a_lock(pg_dsn, stuck.schema), what="the stuck finish")
                for n in range(1, 21):
                    outbox.enqueue(conn, topic, {"n": n}, key=f"k{n % 4}", schema=other.schema)
                    conn.commit()
            wait_for(
                lambda: count(pg_dsn, other.schema, "delivered") == 21, timeout=20, what="the other outbox"
            )
            assert count(pg_dsn, stuck.schema, "events") == 1  # still locked in its batch
            locker.rollback()
        wait_for(lambda: count(pg_dsn, stuck.schema, "delivered") == 2, what="the stuck outbox, unlocked")
        assert count(pg_dsn, stuck.schema, "events") == 0
    assert len({m.event_id for m in read_topic(kafka, topic, 23)}) == 23
