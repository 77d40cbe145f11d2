"""`outbox transform test`: the function on the latest archived events, before and after, changing
nothing; a bad spec is one line."""

from __future__ import annotations

import psycopg
import pytest

import outbox
from outbox.cli import main
from outbox.relay.relay import RelayConfig
from tests.helpers import count, running_relay, wait_for


def test_it_shows_the_latest_archived_events_before_and_after_and_changes_nothing(
    pg_dsn: str, schema: str, kafka: str, topic: str, capsys: pytest.CaptureFixture[str]
) -> None:
    events = [{"topic": topic, "key": f"k{i}", "payload": {"n": i, "drop": i == 11}} for i in range(12)]
    events.append(
        {"topic": topic, "key": "k12", "payload": {"n": 12, "boom": True}, "headers": {"note": "\x1b[31mred"}}
    )
    events.append({"topic": "other", "payload": {"n": 99}})
    with psycopg.connect(pg_dsn) as conn:
        ids = outbox.enqueue_many(conn, events, schema=schema)
    with running_relay(RelayConfig(pg_dsn, schema=schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == len(events), timeout=60, what="the archive")
    capsys.readouterr()
    base = ["transform", "test", "--dsn", pg_dsn, "--schema", schema]
    assert main([*base, f"{topic}=tests.transforms:reshape", "--last", "3"]) == 0
    out = capsys.readouterr().out
    shown = [line.split()[1] for line in out.splitlines() if line.startswith("event ")]
    assert shown == [str(i) for i in ids[10:13]], "the last three of the topic, oldest first"
    assert f"topic='{topic}.v2' key='new-k10'" in out
    assert "x-transformed" in out and 'payload=\'{"order":10,"version":2}\'' in out
    assert "after:  dropped (archived as filtered)" in out
    assert (
        "after:  dead letter (transform_failed): 'transform tests.transforms:reshape raised ValueError" in out
    )
    assert "\x1b" not in out and "\\x1b[31mred" in out, "a header's escape sequence is shown escaped"
    assert count(pg_dsn, schema, "delivered") == len(events) and count(pg_dsn, schema, "dead_letters") == 0
    assert count(pg_dsn, schema, "events") == 0

    assert main([*base, "nope*=tests.transforms:noop"]) == 0
    assert capsys.readouterr().out.strip() == "no archived events of these topics"
    assert main([*base, f"{topic}=tests.transforms:nothing_here"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"outbox: error: --transform {topic}=tests.transforms:nothing_here: module")
    assert err.count("\n") == 1
