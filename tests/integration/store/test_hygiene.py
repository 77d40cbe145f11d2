"""The relay keeps its hot table small, even with autovacuum off or lagging."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import psycopg
import pytest

import outbox
from outbox.relay.relay import RelayConfig
from outbox.store.hygiene import Hygiene
from outbox.store.queries import query
from tests.helpers import count, running_relay, wait_for


def _stats(dsn: str, schema: str) -> tuple[int, int, int]:
    """Dead tuples, live tuples, and the heap's bytes (what VACUUM truncates; not its indexes)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query("hot_table_stats", schema), {"schema": schema}).fetchone()
        heap = conn.execute(f"SELECT pg_relation_size('\"{schema}\".events')").fetchone()
        assert row is not None and heap is not None
        return int(row[0]), int(row[1]), int(heap[0])


def _vacuum_count(dsn: str, schema: str) -> int:
    """How many times the statistics have seen ``events`` vacuumed (by hand or by the relay)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT vacuum_count FROM pg_stat_user_tables WHERE schemaname = %s AND relname = 'events'",
            (schema,),
        ).fetchone()
        return int(row[0]) if row else 0


def _horizon(dsn: str) -> int:
    """A transaction id from now: once no session in the database is older, VACUUM may remove
    every tuple deleted before this call."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT txid_current() % 4294967296").fetchone()
        assert row is not None
        return int(row[0])


def _holders(dsn: str, schema: str, horizon: int) -> list[tuple[Any, ...]]:
    """Other sessions of this database that stop a vacuum from emptying and truncating the
    table's last pages: one with a snapshot or transaction older than ``horizon`` (its tuples
    deleted since are only "recently dead"), or one holding a lock on the table (the truncation
    needs an exclusive lock and gives up after 5 s). An autovacuum ANALYZE of another test's
    table holds a snapshot too: this database is the whole worker's."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            """
            SELECT a.pid, a.backend_type, a.state, left(a.query, 80)
              FROM pg_stat_activity a
             WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
               AND (age(a.backend_xmin) >= age(%(h)s::text::xid)
                    OR age(a.backend_xid) >= age(%(h)s::text::xid)
                    OR EXISTS (SELECT FROM pg_locks l
                                WHERE l.pid = a.pid AND l.relation = %(t)s::regclass))
            """,
            {"h": horizon, "t": f'"{schema}".events'},
        ).fetchall()


def _quiet(dsn: str, schema: str) -> None:
    """Wait until a vacuum now can truncate the drained table (see ``_holders``); the relay
    itself looks again a check later, this test vacuums once."""
    horizon = _horizon(dsn)
    try:
        wait_for(lambda: not _holders(dsn, schema, horizon), timeout=60, interval=0.2)
    except AssertionError:
        raise AssertionError(
            f"sessions kept holding the table back: {_holders(dsn, schema, horizon)}"
        ) from None


def _shows_vacuums_then_dead(dsn: str, schema: str, vacuums: int) -> bool:
    return _vacuum_count(dsn, schema) == vacuums and _stats(dsn, schema)[0] > 0


def _fill_and_drain(dsn: str, schema: str, kafka: str, topic: str, n: int, **relay: Any) -> None:
    with psycopg.connect(dsn) as conn:
        for start in range(0, n, 10_000):
            outbox.enqueue_many(
                conn,
                [{"topic": topic, "payload": b"x" * 200} for _ in range(min(10_000, n - start))],
                schema=schema,
            )
            conn.commit()
    with running_relay(RelayConfig(dsn, schema=schema, **relay), bootstrap=kafka):
        wait_for(lambda: count(dsn, schema, "events") == 0, timeout=60)


def test_hygiene_vacuums_a_drained_table_back_to_near_zero(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:  # as if autovacuum were off
        conn.execute(f'ALTER TABLE "{schema}".events SET (autovacuum_enabled = false)')
    _fill_and_drain(pg_dsn, schema, kafka, topic, 30_000, vacuum=False)
    # Statistics reach pg_stat_user_tables within a second or so of the relay's commits.
    wait_for(lambda: _stats(pg_dsn, schema)[0] >= 20_000, timeout=30, what="dead tuples in stats")
    dead, _, size = _stats(pg_dsn, schema)
    assert size > 4 << 20, f"table only {size} bytes: the test proves nothing"

    _quiet(pg_dsn, schema)
    hygiene = Hygiene(pg_dsn, schema, threading.Event(), threshold=20_000)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        hygiene.check(conn)
    assert hygiene.vacuums == 1
    # Before PostgreSQL 15 the statistics collector reports the vacuum up to a second or so later.
    wait_for(lambda: _stats(pg_dsn, schema)[0] < dead // 10, timeout=10, what="dead tuples after vacuum")
    _, _, size_after = _stats(pg_dsn, schema)
    assert size_after <= 1 << 20, f"{size_after} bytes after vacuum (was {size})"


def test_a_drained_table_whose_statistics_were_reset_is_still_vacuumed(pg_dsn: str, schema: str) -> None:
    """A crash (or pg_stat_reset) zeroes a table's statistics: an empty 5 MiB table then reads
    0 dead and 0 live tuples. Asking for dead tuples first, the relay never looked at it again."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(f'ALTER TABLE "{schema}".events SET (autovacuum_enabled = false)')
        outbox.enqueue_many(
            conn, [{"topic": "t", "payload": b"x" * 200} for _ in range(20_000)], schema=schema
        )
        conn.execute(f'DELETE FROM "{schema}".events')
    wait_for(lambda: _stats(pg_dsn, schema)[0] >= 15_000, timeout=30, what="dead tuples in stats")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f"SELECT pg_stat_reset_single_table_counters('\"{schema}\".events'::regclass)")
    # Before PostgreSQL 15 the statistics collector applies the reset a moment later.
    wait_for(lambda: _stats(pg_dsn, schema)[:2] == (0, 0), timeout=10, what="statistics reset")
    size = _stats(pg_dsn, schema)[2]
    assert size > 4 << 20, f"table only {size} bytes: the test proves nothing"
    _quiet(pg_dsn, schema)
    hygiene = Hygiene(pg_dsn, schema, threading.Event(), threshold=5_000)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        hygiene.check(conn)
    assert hygiene.vacuums == 1
    assert _stats(pg_dsn, schema)[2] <= 1 << 20


def test_relay_keeps_the_table_small_by_itself(
    pg_dsn: str, schema: str, kafka: str, topic: str, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'ALTER TABLE "{schema}".events SET (autovacuum_enabled = false)')
    config = RelayConfig(pg_dsn, schema=schema, vacuum=True, vacuum_threshold=5_000)
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn, [{"topic": topic, "payload": b"x" * 200} for _ in range(30_000)], schema=schema
        )
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60)
        try:
            wait_for(lambda: _stats(pg_dsn, schema)[2] <= 1 << 20, timeout=30, interval=0.5)
        except AssertionError:
            vacuums = [r.getMessage() for r in caplog.records if r.name == "outbox.hygiene"]
            raise AssertionError(
                f"the relay's vacuum did not shrink the drained table: (dead, live, heap bytes) "
                f"{_stats(pg_dsn, schema)}; its hygiene log: {vacuums}"
            ) from None


def test_a_table_that_cannot_shrink_yet_is_looked_at_less_and_less(pg_dsn: str, schema: str) -> None:
    """Nearly drained, large, and its last page holds a pending event (a slow sink's backlog):
    VACUUM frees the dead tuples but cannot truncate the file. Checked every 5 s, it was
    vacuumed every 5 s with a log line each, to no end; now each such vacuum doubles the wait."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(f'ALTER TABLE "{schema}".events SET (autovacuum_enabled = false)')
        outbox.enqueue_many(
            conn, [{"topic": "t", "payload": b"x" * 200} for _ in range(8_000)], schema=schema
        )
        conn.execute(f'DELETE FROM "{schema}".events WHERE id < (SELECT max(id) FROM "{schema}".events)')
        row = conn.execute(f'SELECT max(id) FROM "{schema}".events').fetchone()
        assert row is not None
        pinned = row[0]
    wait_for(lambda: _stats(pg_dsn, schema)[0] >= 7_000, timeout=30, what="dead tuples in stats")
    assert _stats(pg_dsn, schema)[2] > 1 << 20, "the table is not large: the test proves nothing"
    hygiene = Hygiene(pg_dsn, schema, threading.Event())
    waits = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        # A first vacuum records the free space, so the rows written below go into it and not
        # into pages past the pending event (PostgreSQL 16+ extends a table several pages at a
        # time); it cannot truncate below the pending event either.
        conn.execute(f'VACUUM "{schema}".events')
        for _ in range(3):
            hygiene._next.clear()  # each look as if its time had come
            # A dead tuple or so: an event written and delivered. The pending one stays where it is.
            # Written by a session that then ends, which sends its counts to the statistics at
            # once (before PostgreSQL 15 an idle session may hold them back indefinitely).
            with psycopg.connect(pg_dsn, autocommit=True) as writer:
                writer.execute(
                    f'INSERT INTO "{schema}".events (event_id, topic, payload) VALUES (gen_random_uuid(), %s, %s)', ("t", b"x")
                )  # fmt: skip
                writer.execute(f'DELETE FROM "{schema}".events WHERE id > %s', (pinned,))
            # The statistics must show the last vacuum (which zeroes the dead count) and then
            # this dead tuple; before PostgreSQL 15 they arrive late and can be read stale.
            wait_for(
                functools.partial(_shows_vacuums_then_dead, pg_dsn, schema, 1 + hygiene.vacuums),
                timeout=30,
                what="the last vacuum and then a dead tuple in stats",
            )
            before = hygiene.vacuums
            hygiene.check(conn)
            assert hygiene.vacuums == before + 1
            waits.append(round(hygiene._next[schema] - time.monotonic()))
    assert waits == [10, 20, 40], waits
    assert _stats(pg_dsn, schema)[2] > 1 << 20  # still large: the pending event is on its last page


def test_a_snapshot_held_open_is_reported_and_one_just_begun_is_not(
    pg_dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A vacuum that cannot remove the dead tuples warns, with the snapshot's age, and backs off
    only when a snapshot older than a check holds them: then scanning again is useless. One that
    just began (the relay's own batches in a drain) or statistics that do not show the vacuum
    yet (before PostgreSQL 15) is looked at again at the next check, without a warning (found in
    the matrix: a drained table stayed large past the backoff)."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'ALTER TABLE "{schema}".events SET (autovacuum_enabled = false)')

    def held_for(hygiene: Hygiene, seconds: float, n: int) -> float:
        """``n`` dead tuples made behind a snapshot held ``seconds`` before the vacuum: the
        pause before the next look."""
        holder = psycopg.connect(pg_dsn)
        try:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT 1")  # the snapshot: what is deleted after it stays
            with psycopg.connect(pg_dsn) as conn:
                outbox.enqueue_many(conn, [{"topic": "t", "payload": b"x"} for _ in range(n)], schema=schema)
                conn.commit()
                conn.execute(f'DELETE FROM "{schema}".events')
                conn.commit()
            wait_for(lambda: _stats(pg_dsn, schema)[0] >= n, timeout=30, what="dead tuples in stats")
            time.sleep(seconds)
            caplog.clear()
            with psycopg.connect(pg_dsn, autocommit=True) as conn, caplog.at_level("DEBUG", "outbox.hygiene"):
                started = time.monotonic()
                hygiene.check(conn)
            return hygiene._next[schema] - started
        finally:
            holder.close()

    # Just begun: younger than a check. The interval is long here because writing and deleting
    # the 5,000 events took over 2 s on a loaded machine (the version matrix), which made the
    # snapshot older than a 2 s check by the time the vacuum ran.
    assert (
        held_for(Hygiene(pg_dsn, schema, threading.Event(), threshold=1_000, interval=60.0), 0.0, 5_000)
        <= 60.5
    )
    assert not [r for r in caplog.records if r.levelname == "WARNING"], caplog.text
    assert "looking again at the next check" in caplog.text, caplog.text
    hygiene = Hygiene(pg_dsn, schema, threading.Event(), threshold=1_000, interval=2.0)
    wait = held_for(hygiene, 3.0, 15_000)  # the first 5,000 go; these stay
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "a snapshot is held open (oldest for " in warnings[0], warnings
    assert int(warnings[0].split("(oldest for ")[1].split(" s)")[0]) >= 3, warnings
    assert wait >= 2.0


def test_a_snapshot_held_through_many_checks_is_one_line_when_it_starts_and_one_when_it_ends(
    pg_dsn: str, schema: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A held snapshot is an outage of the table's hygiene: the table is looked at every few
    seconds while it lasts, and each look used to warn again (a line every 5 s in the
    10-minute held-snapshot bench). One line when it starts, at most a summary a minute, one
    line when a vacuum removes the dead tuples again."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'ALTER TABLE "{schema}".events SET (autovacuum_enabled = false)')
    hygiene = Hygiene(pg_dsn, schema, threading.Event(), threshold=1_000, interval=1.0)
    holder = psycopg.connect(pg_dsn)
    holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT 1")  # the snapshot: what is deleted after it stays
    made = 0

    def dead_tuples(n: int) -> None:
        nonlocal made
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue_many(conn, [{"topic": "t", "payload": b"x"} for _ in range(n)], schema=schema)
            conn.commit()
            conn.execute(f'DELETE FROM "{schema}".events')
            conn.commit()
        made += n
        wait_for(lambda: _stats(pg_dsn, schema)[0] >= made, timeout=30, what="dead tuples in stats")

    def look() -> list[str]:
        caplog.clear()
        hygiene._next.clear()  # due now, as after its backoff
        with psycopg.connect(pg_dsn, autocommit=True) as conn, caplog.at_level("INFO", "outbox.hygiene"):
            hygiene.check(conn)
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]

    try:
        time.sleep(1.5)  # older than a check: held, not just begun
        lines = []
        for _ in range(4):
            dead_tuples(2_000)
            lines += look()
        assert len(lines) == 1, lines
        assert "a snapshot is held open (oldest for " in lines[0] and f"{schema}.events" in lines[0], lines
    finally:
        holder.close()
    dead_tuples(2_000)  # the vacuum after the release removes them all
    ended = look()
    assert len(ended) == 1 and "recovered after" in ended[0], ended
    assert look() == []  # nothing held: nothing said
