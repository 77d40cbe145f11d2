"""The claim's plan does not depend on fresh statistics: a backlog after an outage has none,
and the per-key guards must still read their partial indexes, not the whole table."""

from __future__ import annotations

import json
from typing import Any

import psycopg
from psycopg import sql

from outbox.queries import query
from outbox.writer import enqueue_many


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
        conn.execute("SET jit = off")  # as the relay's sessions run
        explain = sql.SQL("EXPLAIN (FORMAT JSON) ") + query("claim_batch", schema)
        row = conn.execute(
            explain, {"owner": "00000000-0000-0000-0000-000000000001", "limit": 2000}
        ).fetchone()
        assert row is not None
        plan = row[0] if isinstance(row[0], list) else json.loads(row[0])
        conn.rollback()
    assert "events" not in _relations_scanned(plan, "Seq Scan"), json.dumps(plan)[:2000]
    assert "dead_letters" not in _relations_scanned(plan, "Seq Scan"), json.dumps(plan)[:2000]
