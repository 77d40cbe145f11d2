"""The claim's plan does not depend on fresh statistics: a backlog after an outage has none,
and the per-key guards must still read their partial indexes, not the whole table."""

from __future__ import annotations

import json
import threading
from typing import Any

import psycopg
from psycopg import sql

from outbox.store.queries import query
from outbox.store.sessions import Sessions
from outbox.write.writer import enqueue_many


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
        explain = sql.SQL("EXPLAIN (FORMAT JSON) ") + query("claim_batch", schema)
        row = relay.execute(
            explain,
            {
                "owner": "00000000-0000-0000-0000-000000000001",
                "limit": 2000,
                "skip_keys": [],
                "skip_after": [],
                "only": None,
                "skip": None,
            },
        ).fetchone()
        assert row is not None
        plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
    finally:
        relay.close()
    assert "events" not in _relations_scanned(plan, "Seq Scan"), json.dumps(plan)[:2000]
    assert "dead_letters" not in _relations_scanned(plan, "Seq Scan"), json.dumps(plan)[:2000]


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
        for name in ("claim_batch", "claim_batch_unordered"):
            explain = sql.SQL("EXPLAIN (FORMAT JSON) ") + query(name, schema)
            row = conn.execute(
                explain,
                {
                    "owner": "00000000-0000-0000-0000-000000000001",
                    "limit": 2000,
                    "skip_keys": [],
                    "skip_after": [],
                    "only": None,
                    "skip": None,
                },
            ).fetchone()
            assert row is not None
            plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
            conn.rollback()
            assert "Sort" not in _nodes(plan), (name, json.dumps(plan)[:2000])
            assert "events" not in _relations_scanned(plan, "Seq Scan"), (name, json.dumps(plan)[:2000])
    finally:
        conn.close()
