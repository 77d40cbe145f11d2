"""A rolling upgrade from the previous release (its wheel, built from its tag): with events
flowing throughout, a relay of each version serves one outbox while this version's migrate
runs; writers of both versions write meanwhile. Nothing is lost, per-key order holds, and the
test reports how long the migration made a writer wait."""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.store.migrate import migrate, migrations
from tests.helpers import FAST, ModuleProcess, assert_per_key_order, count, read_topic, wait_for
from tests.previous_release import Release, build

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def previous() -> Release:
    release = build()
    assert release.check() == release.version
    return release


class Old:
    """A process of the previous release (its relay, or the writer script run by it)."""

    def __init__(self, release: Release, *args: str, module: str = "outbox") -> None:
        self.log = open(release.home / f"{uuid.uuid4().hex}.log", "w+")
        self.proc = subprocess.Popen(
            [release.command()[0], "-m", module, *args],
            cwd=release.home,
            env=release.env(),
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _old_migrate(previous: Release, dsn: str, schema: str, *args: str) -> None:
    """The previous release's ``outbox migrate`` of ``schema``."""
    migrated = subprocess.run(
        previous.command("migrate", "--dsn", dsn, "--schema", schema, *args),
        cwd=previous.home, env=previous.env(), capture_output=True, text=True,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr


@pytest.fixture(params=["table", "wal"])
def upgraded(request: pytest.FixtureRequest) -> Iterator[tuple[str, str, str]]:
    """(capture mode, DSN, schema): a schema of its own, dropped after (in WAL capture with its
    slot and publication)."""
    capture_mode: str = request.param
    dsn: str = request.getfixturevalue("pg_dsn" if capture_mode == "table" else "wal_dsn")
    name = f"u_{uuid.uuid4().hex[:12]}"
    yield capture_mode, dsn, name
    with psycopg.connect(dsn, autocommit=True) as conn:
        if capture_mode == "wal":
            for _ in range(100):  # a relay's reader may still be letting go of the slot
                active = conn.execute(
                    "SELECT 1 FROM pg_replication_slots WHERE active AND slot_name LIKE %s", (f"%{name}%",)
                ).fetchone()
                if active is None:
                    break
                time.sleep(0.1)
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name LIKE %s",
                (f"%{name}%",),
            )
            for (publication,) in conn.execute(
                "SELECT pubname FROM pg_publication WHERE pubname LIKE %s", (f"%{name}%",)
            ).fetchall():
                conn.execute(f'DROP PUBLICATION "{publication}"')
        conn.execute(f'DROP SCHEMA IF EXISTS "{name}" CASCADE')


def test_a_rolling_upgrade_from_the_previous_release_loses_nothing_and_keeps_key_order(
    upgraded: tuple[str, str, str], kafka: str, topic: str, previous: Release, tmp_path: Path
) -> None:
    capture_mode, pg_dsn, schema = upgraded
    wal = ("--capture", "wal") if capture_mode == "wal" else ()
    _old_migrate(previous, pg_dsn, schema, *wal)
    stop = tmp_path / "stop"
    writer = ["tests.upgrade_writer", pg_dsn, schema, topic]
    old_writer = Old(previous, *writer[1:], "old-", str(stop), module=writer[0])
    old_relay = Old(previous, "relay", "--dsn", pg_dsn, "--schema", schema, "--kafka-bootstrap", kafka, *FAST)
    new_writer = new_relay = None
    try:
        wait_for(
            lambda: count(pg_dsn, schema, "delivered") >= 200, timeout=60, what="the old relay delivering"
        )
        # This version's migrate, while the old relay claims and the old writer writes.
        started = time.monotonic()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            applied = migrate(conn, schema)
        took = time.monotonic() - started
        assert [m.version for m in applied] == [m.version for m in migrations() if m.version >= 19]
        new_writer = ModuleProcess(*writer, "new-", str(stop))
        new_relay = ModuleProcess(
            "outbox", "relay", "--dsn", pg_dsn, "--schema", schema, "--kafka-bootstrap", kafka, *FAST
        )
        # Both relays serve the outbox, both writers write to it.
        time.sleep(4)
        assert old_relay.stop() == 0, old_relay.output()
        time.sleep(2)
        stop.touch()
        assert new_writer.proc.wait(30) == 0 and old_writer.proc.wait(30) == 0
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="the drain")
        assert new_relay.stop() == 0
        said = {"old": old_writer.output(), "new": new_writer.output()}
    finally:
        stop.touch()
        for process in (old_writer, old_relay, new_writer, new_relay):
            if process is not None:
                process.close()
    rounds = {who: int(out.split("rounds=")[1].split()[0]) for who, out in said.items()}
    written = 8 * (rounds["old"] + rounds["new"])
    assert count(pg_dsn, schema, "delivered") == written and count(pg_dsn, schema, "dead_letters") == 0
    messages = read_topic(kafka, topic, written)
    assert {json.loads(m.value)["k"] for m in messages} >= {f"old-k{k}" for k in range(8)} | {
        f"new-k{k}" for k in range(8)
    }
    assert len({m.event_id for m in messages}) == written, "an event is missing at the broker"
    assert_per_key_order(messages)
    print(
        f"migrate 0019-{applied[-1].version:04d} took {took * 1000:.0f} ms; writers: old {said['old'].strip()}, new {said['new'].strip()}"
    )


def test_expires_at_written_before_the_relays_are_rolled_is_what_the_docs_say(
    upgraded: tuple[str, str, str], kafka: str, topic: str, previous: Release
) -> None:
    """The order docs/operations.md warns against: this version's writer uses ``expires_at``
    while a 0.2.0 relay serves. In table capture the 0.2.0 relay ignores the column and delivers
    the event, expired or not. In WAL capture it reads the message's sixth head field as a
    corrupt event: a dead letter holding the message, never sent, while the rest flows. 0.2.0
    inserts it without a kind: migration 0024's trigger gives it corrupt_event."""
    capture_mode, pg_dsn, schema = upgraded
    wal = ("--capture", "wal") if capture_mode == "wal" else ()
    _old_migrate(previous, pg_dsn, schema, *wal)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, schema)
    past = datetime.now(timezone.utc) - timedelta(seconds=1)
    with psycopg.connect(pg_dsn) as conn:
        plain = [outbox.enqueue(conn, topic, {"seq": 0}, key="a", schema=schema)]
        expiring = outbox.enqueue(conn, topic, {"seq": 0}, key="x", schema=schema, expires_at=past)
        plain.append(outbox.enqueue(conn, topic, {"seq": 1}, key="a", schema=schema))
    old_relay = Old(previous, "relay", "--dsn", pg_dsn, "--schema", schema, "--kafka-bootstrap", kafka, *FAST)
    try:
        if capture_mode == "table":
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 3, timeout=60, what="all three")
        else:
            wait_for(
                lambda: (
                    count(pg_dsn, schema, "delivered") == 2 and count(pg_dsn, schema, "dead_letters") == 1
                ),
                timeout=60,
                what="two delivered and one dead letter",
            )
        assert old_relay.stop() == 0, old_relay.output()
    finally:
        old_relay.close()
    sent = {m.event_id for m in read_topic(kafka, topic, 3 if capture_mode == "table" else 2)}
    assert {str(e) for e in plain} <= sent
    if capture_mode == "table":
        assert str(expiring) in sent and count(pg_dsn, schema, "dead_letters") == 0
        return
    assert str(expiring) not in sent
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT kind, error, payload FROM {}.dead_letters").format(sql.Identifier(schema))
        ).fetchone()
    assert row is not None
    kind, error, payload = row
    assert kind == "corrupt_event", (kind, error)
    assert str(expiring).encode() in bytes(payload), "the dead letter does not hold the message"


@pytest.mark.parametrize("upgraded", ["wal"], indirect=True)
def test_a_strangers_message_a_0_2_0_relay_dead_letters_is_never_redriven_in_bulk(
    upgraded: tuple[str, str, str], kafka: str, topic: str, previous: Release
) -> None:
    """During a rolling upgrade a 0.2.0 relay dead-letters a stranger's WAL message (any role
    may emit one under the outbox's prefix) without a kind, which 0.2.0 does not know. Migration
    0024's trigger gives it its kind, unsigned_event, so this version's bulk redrive leaves it:
    taken, a catch-all route would deliver the stranger's content."""
    from outbox.cli import main

    _, pg_dsn, schema = upgraded
    _old_migrate(previous, pg_dsn, schema, "--capture", "wal")
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, schema)
        conn.execute(
            "SELECT pg_logical_emit_message(true, %s, %s::bytea)",
            (f"outbox:{schema}", b"a stranger's content"),
        )
    with psycopg.connect(pg_dsn) as conn:
        genuine = outbox.enqueue(conn, topic, {"n": 1}, key="k", schema=schema)
    old_relay = Old(previous, "relay", "--dsn", pg_dsn, "--schema", schema, "--kafka-bootstrap", kafka, *FAST)
    try:
        wait_for(
            lambda: count(pg_dsn, schema, "delivered") == 1 and count(pg_dsn, schema, "dead_letters") == 1,
            timeout=60,
            what="the event delivered and the stranger's message dead-lettered",
        )
        assert old_relay.stop() == 0, old_relay.output()
    finally:
        old_relay.close()
    assert [m.event_id for m in read_topic(kafka, topic, 1)] == [str(genuine)]
    base = ["--dsn", pg_dsn, "--schema", schema]
    assert main(["dead", "redrive", *base, "--all", "--yes"]) == 1  # nothing it may take
    assert main(["retry", *base, "--yes"]) == 1
    assert count(pg_dsn, schema, "events") == 0 and count(pg_dsn, schema, "dead_letters") == 1
    with psycopg.connect(pg_dsn) as conn:
        kinds = conn.execute(
            sql.SQL("SELECT kind FROM {}.dead_letters").format(sql.Identifier(schema))
        ).fetchall()
    assert kinds == [("unsigned_event",)]
