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
from pathlib import Path

import psycopg
import pytest

from outbox.store.migrate import migrate
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
    migrated = subprocess.run(
        previous.command("migrate", "--dsn", pg_dsn, "--schema", schema, *wal),
        cwd=previous.home, env=previous.env(), capture_output=True, text=True,
    )  # fmt: skip
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr
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
        assert [m.version for m in applied] == [19, 20, 21, 22, 23]
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
        f"migrate 0019-0023 took {took * 1000:.0f} ms; writers: old {said['old'].strip()}, new {said['new'].strip()}"
    )
