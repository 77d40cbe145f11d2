"""Operator commands: retry, replay, purge — with dry runs and confirmation."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import sys
from typing import Any

import psycopg

import outbox
from outbox.relay.relay import RelayConfig
from tests.helpers import count, read_topic, running_relay, wait_for


def _outbox(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )


def _trail(dsn: str, schema: str) -> list[dict[str, Any]]:
    """The audit trail as `outbox audit --json` prints it, newest first."""
    out = _outbox("audit", "--dsn", dsn, "--schema", schema, "--json")
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout))


def _dead(dsn: str, schema: str, topic: str, error: str, n: int) -> None:
    with psycopg.connect(dsn) as conn:
        for i in range(n):
            conn.execute(
                f'INSERT INTO "{schema}".dead_letters (id, event_id, topic, key, payload, headers, '
                "created_at, attempts, error, first_failed_at, failed_at) "
                "VALUES (%s, gen_random_uuid(), %s, %s, %s, '{}', now(), 10, %s, now(), now())",
                (1_000_000 + i + (0 if "timed" in error else 500), topic, f"k{i}".encode(), b"p", error),
            )


def test_retry_filters_dry_run_and_confirmation(pg_dsn: str, schema: str) -> None:
    _dead(pg_dsn, schema, "orders", "MSG_TIMED_OUT: timed out", 3)
    _dead(pg_dsn, schema, "orders", "TOPIC_AUTHORIZATION_FAILED: denied", 2)
    common = ("--dsn", pg_dsn, "--schema", schema)
    out = _outbox("retry", *common, "--error-like", "%timed out%", "--dry-run")
    assert out.returncode == 0 and "would retry 3" in out.stdout
    assert count(pg_dsn, schema, "dead_letters") == 5
    out = _outbox("retry", *common, "--error-like", "%timed out%")  # no terminal, no --yes
    assert out.returncode == 2 and "--yes" in out.stderr
    assert count(pg_dsn, schema, "dead_letters") == 5
    assert _trail(pg_dsn, schema) == [], "a dry run or a refusal is not an action"
    out = _outbox("retry", *common, "--error-like", "%timed out%", "--yes")
    assert out.returncode == 0, out.stderr
    assert count(pg_dsn, schema, "dead_letters") == 2
    assert count(pg_dsn, schema, "events", "attempts = 0") == 3
    [entry] = _trail(pg_dsn, schema)
    assert entry["via"] == "cli" and entry["action"] == "redrive" and "@" in entry["actor"]
    assert entry["planned"] == entry["done"] == 3 and entry["finished_at"] is not None
    assert entry["selector"] == {"error_like": "%timed out%"}
    assert entry["command"] == "outbox dead redrive --error-like '%timed out%' --yes"


def test_dead_redrive_and_skip_take_the_same_selector_dry_run_and_confirmation(
    pg_dsn: str, schema: str
) -> None:
    _dead(pg_dsn, schema, "orders", "MSG_TIMED_OUT: timed out", 2)
    common = ("--dsn", pg_dsn, "--schema", schema)
    out = _outbox("dead", "redrive", *common)
    assert out.returncode == 2 and "--key" in out.stderr and "--all" in out.stderr
    out = _outbox("dead", "skip", *common, "42")
    assert out.returncode == 1 and "no dead letter matches" in out.stderr
    out = _outbox("dead", "redrive", *common, "--topic", "orders", "--dry-run")
    assert out.returncode == 0 and "would redrive 2" in out.stdout
    out = _outbox("dead", "redrive", *common, "--topic", "orders")  # no terminal, no --yes
    assert out.returncode == 2 and "--yes" in out.stderr
    assert count(pg_dsn, schema, "dead_letters") == 2
    out = _outbox("dead", "list", *common, "--error-like", "%timed%", "--json")
    assert out.returncode == 0 and len(json.loads(out.stdout)) == 2
    out = _outbox("dead", "redrive", *common, "--topic", "orders", "--yes")
    assert out.returncode == 0, out.stderr
    assert count(pg_dsn, schema, "dead_letters") == 0 and count(pg_dsn, schema, "events") == 2
    _dead(pg_dsn, schema, "payments", "TOPIC_AUTHORIZATION_FAILED: denied", 1)
    out = _outbox("dead", "skip", *common, "--key", "k0", "--ids", "1000500", "--yes")
    assert out.returncode == 0, out.stderr
    skip, redrive = _trail(pg_dsn, schema)
    assert (redrive["action"], redrive["selector"], redrive["done"]) == (
        "redrive",
        {"topic": "orders"},
        2,
    )
    assert (skip["action"], skip["selector"], skip["planned"]) == (
        "skip",
        {"key": "k0", "ids": [1_000_500]},
        1,
    )
    assert skip["command"] == "outbox dead skip --key k0 --ids 1000500 --yes"


def test_replay_resends_archived_events_with_new_ids(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        originals = outbox.enqueue_many(
            conn, [{"topic": topic, "payload": f"e{i}", "key": "k"} for i in range(50)], schema=schema
        )
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1)
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 50)
        common = ("--dsn", pg_dsn, "--schema", schema, "--since", "1h", "--topic", topic)
        dry = _outbox("replay", *common, "--dry-run")
        assert dry.returncode == 0 and "would replay 50" in dry.stdout
        out = _outbox("replay", *common, "--yes")
        assert out.returncode == 0, out.stderr
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 100)
    [entry] = _trail(pg_dsn, schema)
    assert (entry["action"], entry["planned"], entry["done"], entry["selector"]["topic"]) == (
        "replay",
        50,
        50,
        topic,
    )
    assert entry["command"].startswith("outbox replay --since ") and f"--topic {topic}" in entry["command"]
    messages = read_topic(kafka, topic, 100)
    replayed = [m for m in messages if "outbox-replay-of" in m.headers]
    assert len(replayed) == 50
    assert {m.headers["outbox-replay-of"].decode() for m in replayed} == {str(e) for e in originals}
    assert not {m.event_id for m in replayed} & {str(e) for e in originals}
    assert [m.value for m in replayed] == [f"e{i}".encode() for i in range(50)]  # in order


def test_purge_drops_old_partitions_only(pg_dsn: str, schema: str) -> None:
    old_day = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=40)).date()
    name = f"delivered_p{old_day:%Y%m%d}"
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            f'CREATE TABLE "{schema}"."{name}" PARTITION OF "{schema}".delivered '
            "FOR VALUES FROM (%s::date::timestamp AT TIME ZONE 'UTC') "
            "TO ((%s::date + 1)::timestamp AT TIME ZONE 'UTC')".replace("%s", f"'{old_day}'")
        )
        conn.execute(
            f'INSERT INTO "{schema}".delivered (id, event_id, topic, payload, headers, created_at, '
            "delivered_at, attempts) VALUES (1, gen_random_uuid(), 't', 'x', '{}', now(), %s, 1)",
            (dt.datetime.combine(old_day, dt.time(12), dt.timezone.utc),),
        )
    before = _outbox("status", "--dsn", pg_dsn, "--schema", schema, "--json")
    assert json.loads(before.stdout)["delivered"] == 1
    common = ("--dsn", pg_dsn, "--schema", schema, "--older-than", "30d")
    dry = _outbox("purge", *common, "--dry-run")
    assert dry.returncode == 0 and name in dry.stdout
    out = _outbox("purge", *common, "--yes")
    assert out.returncode == 0, out.stderr
    with psycopg.connect(pg_dsn) as conn:
        left = [
            r[0]
            for r in conn.execute(
                "SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid "
                "JOIN pg_class p ON p.oid = i.inhparent JOIN pg_namespace n ON n.oid = p.relnamespace "
                "WHERE n.nspname = %s AND p.relname = 'delivered'",
                (schema,),
            )
        ]
    assert name not in left
    today = f"delivered_p{dt.datetime.now(dt.timezone.utc):%Y%m%d}"
    assert today in left and "delivered_default" in left
    assert count(pg_dsn, schema, "delivered") == 0
    [entry] = _trail(pg_dsn, schema)
    assert (entry["action"], entry["planned"], entry["done"]) == ("purge", 1, 1)
    assert entry["selector"]["partitions"] == [name]
    assert entry["command"] == "outbox purge --older-than 30d --yes"
    out = _outbox("purge", *common, "--older-than", "soon")
    assert out.returncode == 2 and "--older-than" in out.stderr
