"""The claim's plan does not depend on fresh statistics: a backlog after an outage has none,
and the per-key guards must still read their partial indexes, not the whole table."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox.store.queries import query
from outbox.store.sessions import Sessions
from outbox.write.writer import enqueue_many

# Every claim the relay sends: ordered and not, with limits and key skips or without (Ordering).
CLAIMS = [
    (name, fragments)
    for name, limits in (("claim_batch", "claim_limits_ordered"), ("claim_batch_unordered", "claim_limits"))
    for fragments in (
        {"limits": None, "skips": None},
        {"limits": limits, "skips": None},
        {"limits": None, "skips": "claim_skips"},
    )
]
PARAMS = {
    "owner": "00000000-0000-0000-0000-000000000001",
    "limit": 2000,
    "skip_keys": [b"k1"],
    "skip_after": [1],
    "only": None,
    "skip": "^x$",
}
# The claim without limits or skips has a generic plan PostgreSQL caches after five executions; both kinds
# of plan must walk the indexes.
PLAN_MODES = ("force_custom_plan", "force_generic_plan")


def _plans(conn: psycopg.Connection[Any], schema: str) -> list[tuple[str, dict[str, str | None], str, Any]]:
    """(claim, its fragments, plan mode, plan) for every claim and both kinds of plan."""
    plans = []
    for name, fragments in CLAIMS:
        for mode in PLAN_MODES:
            conn.execute(sql.SQL("SET plan_cache_mode = {}").format(sql.SQL(mode)))
            explain = sql.SQL("EXPLAIN (FORMAT JSON) ") + query(name, schema, fragments=fragments)
            row = conn.execute(explain, PARAMS).fetchone()
            assert row is not None
            plans.append((name, fragments, mode, row[0] if isinstance(row[0], list) else json.loads(row[0])))
            conn.rollback()
    return plans


def _relations_scanned(plan: Any, kind: str) -> set[str]:
    found: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        if node.get("Node Type") == kind and "Relation Name" in node:
            found.add(node["Relation Name"])
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return found


def test_claim_guards_use_their_partial_indexes_without_statistics(pg_dsn: str, schema: str) -> None:
    table = sql.Identifier(schema, "events")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:  # no autovacuum: no ANALYZE behind our back
        admin.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(table))
    with psycopg.connect(pg_dsn) as conn:
        for start in range(0, 50_000, 10_000):
            enqueue_many(
                conn,
                [
                    {"topic": "t", "key": f"k{i % 1000}", "payload": {"i": i}}
                    for i in range(start, start + 10_000)
                ],
                schema=schema,
            )
            conn.commit()
        stats = conn.execute(
            "SELECT count(*) FROM pg_stats WHERE schemaname = %s AND tablename = 'events'", (schema,)
        ).fetchone()
        assert stats == (0,)  # the premise: no statistics
    relay = Sessions(pg_dsn, lease=30.0, stop=threading.Event()).connect()  # the relay's session settings
    try:
        plans = _plans(relay, schema)
    finally:
        relay.close()
    for name, fragments, mode, plan in plans:
        said = (name, fragments, mode, json.dumps(plan)[:2000])
        assert "events" not in _relations_scanned(plan, "Seq Scan"), said
        assert "dead_letters" not in _relations_scanned(plan, "Seq Scan"), said


def _nodes(plan: Any) -> set[str]:
    found: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        found.add(node["Node Type"])
        for child in node.get("Plans", []):
            walk(child)

    walk(plan[0]["Plan"])
    return found


def test_claim_walks_the_primary_key_when_the_backlog_is_counted_but_not_analyzed(
    pg_dsn: str, schema: str
) -> None:
    """A VACUUM without ANALYZE (autovacuum's, after a big insert) sets the row count but no
    column statistics: the planner then expects a few hundred rows past the claim's filters
    and would sort the whole table (620 ms per claim at 200,000 pending, measured). The
    relay's sessions must still walk the primary key in id order."""
    table = sql.Identifier(schema, "events")
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(table))
    with psycopg.connect(pg_dsn) as conn:
        for start in range(0, 100_000, 20_000):
            enqueue_many(
                conn,
                [
                    {"topic": "t", "key": f"k{i % 1000}", "payload": {"i": i}}
                    for i in range(start, start + 20_000)
                ],
                schema=schema,
            )
            conn.commit()
    with psycopg.connect(pg_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("VACUUM {}").format(table))  # counted, not analyzed
        stats = admin.execute(
            "SELECT count(*) FROM pg_stats WHERE schemaname = %s AND tablename = 'events'", (schema,)
        ).fetchone()
        assert stats == (0,)
    sessions = Sessions(pg_dsn, lease=30.0, stop=threading.Event())
    conn = sessions.connect()  # the relay's own session settings
    try:
        plans = _plans(conn, schema)
    finally:
        conn.close()
    for name, fragments, mode, plan in plans:
        assert "Sort" not in _nodes(plan), (name, fragments, mode, json.dumps(plan)[:2000])
        assert "events" not in _relations_scanned(plan, "Seq Scan"), (
            name,
            fragments,
            mode,
            json.dumps(plan)[:2000],
        )


@pytest.mark.parametrize("ordering", ["key", "none"])
def test_a_relay_without_limits_claims_with_a_cached_plan_not_one_planned_per_claim(
    pg_dsn: str, schema: str, ordering: str
) -> None:
    """At low load a claim takes one event or none, and planning the claim took as long as running
    it. Without limits, the claim carries no clause PostgreSQL could fold for the values of the
    moment, so after its five custom plans it runs the plan it cached; and a claim that sends
    nothing ends with a COMMIT, since psycopg forgets its prepared statements at a ROLLBACK."""
    from tests.integration.relay.test_ordering import _beat, _ordering

    relay = _ordering(pg_dsn, schema, "r", 30.0, ordering=ordering)
    sessions = Sessions(pg_dsn, lease=30.0, stop=threading.Event())
    conn = None
    try:
        conn = sessions.take()
        assert conn is not None
        _beat(relay, [conn.info.backend_pid])
        for i in range(12):
            if i % 2:
                with psycopg.connect(pg_dsn) as writer:
                    enqueue_many(writer, [{"topic": "t", "key": f"k{i}", "payload": {"i": i}}], schema=schema)
            assert len(relay.claim(conn, 100)) == (i + 1) // 2  # none is finished: they add up
            sessions.end(conn)  # as the relay ends a claim it does not send
            assert sessions.take() is conn
        # PostgreSQL 14 counts each prepared statement's plans; 13 only lists what is prepared.
        counted = conn.info.server_version >= 140000
        plans = conn.execute(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE statement LIKE %s"
            if counted
            else "SELECT name, NULL FROM pg_prepared_statements WHERE statement LIKE %s",
            ("%FOR UPDATE OF e SKIP LOCKED%",),
        ).fetchall()
    finally:
        if conn is not None:
            conn.close()
        sessions.close_all()
        relay.link.close()
    if counted:
        assert plans == [(12 - 5 - 5, 5)], "the claim was planned anew each time"  # prepared at the 6th
    else:
        assert len(plans) == 1, "the claim was not kept prepared across the claims' ends"
