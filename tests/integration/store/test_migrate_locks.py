"""A migration that waits for its lock lets go every --lock-timeout, so writers never queue behind
it for long, and gives up after --lock-wait in one line naming what it waited on.

The scene of a rolling upgrade with a slow sink: a relay's batch holds its rows' locks (its
claim transaction stays open until the sink answers) while ``outbox migrate`` applies 0023,
whose ALTER TABLE needs the events table to itself. Without a lock timeout the ALTER waited for
the batch, and every writer's INSERT waited behind the ALTER: the application stopped for as
long as the sink took."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox.store.lock_wait import LockWait, LockWaitExpired
from outbox.store.migrate import migrate

LAST = 23  # the migration taken back and applied again: 0023_expiry's two ALTER TABLEs


def _before_last(conn: psycopg.Connection[Any], schema: str) -> None:
    """``schema`` as a release before 0023 left it (the columns 0023 adds are all it made)."""
    for table in ("events", "dead_letters"):
        conn.execute(
            sql.SQL("ALTER TABLE {}.{} DROP COLUMN expires_at").format(
                sql.Identifier(schema), sql.Identifier(table)
            )
        )
    conn.execute(
        sql.SQL("DELETE FROM {}.schema_migrations WHERE version = %s").format(sql.Identifier(schema)), (LAST,)
    )


@pytest.fixture
def batch_in_flight(pg_dsn: str, schema: str) -> Iterator[psycopg.Connection[Any]]:
    """``schema`` before 0023, and a relay's batch in flight on it: a claim transaction holding
    its event's row lock (as a relay's does until the sink answers), open until the test ends."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        _before_last(conn, schema)
    with psycopg.connect(pg_dsn) as conn:
        _write(conn, schema)
        conn.commit()
    holder = psycopg.connect(pg_dsn)
    holder.execute(
        sql.SQL("SELECT id FROM {}.events ORDER BY id LIMIT 1 FOR UPDATE SKIP LOCKED").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    try:
        yield holder
    finally:
        holder.close()


def _write(conn: psycopg.Connection[Any], schema: str) -> None:
    """One event as a writer of the release before writes it (this one's names ``expires_at``,
    which 0023 adds: writers are rolled after the migration)."""
    conn.execute(
        sql.SQL(
            "INSERT INTO {}.events (event_id, topic, payload) VALUES (gen_random_uuid(), 't', %s)"
        ).format(sql.Identifier(schema)),
        (b"written meanwhile",),
    )


def _applied(dsn: str, schema: str) -> bool:
    with psycopg.connect(dsn) as conn:
        q = sql.SQL("SELECT 1 FROM {}.schema_migrations WHERE version = %s").format(sql.Identifier(schema))
        return conn.execute(q, (LAST,)).fetchone() is not None


def test_writers_go_on_while_a_migration_waits_for_a_batch_s_lock(
    pg_dsn: str, schema: str, batch_in_flight: psycopg.Connection[Any]
) -> None:
    tries: list[int] = []
    got: list[tuple[str, int]] = []
    done: list[Any] = []
    locks = LockWait(
        timeout=0.3,
        wait=60,
        waiting=lambda what, n, waited, pause: tries.append(n),
        got=lambda what, n, waited: got.append((what, n)),
    )

    def run() -> None:
        with psycopg.connect(pg_dsn) as conn:
            done.append(migrate(conn, schema, locks=locks))

    migrating = threading.Thread(target=run)
    migrating.start()
    try:
        # A writer in transactions of its own, each given 5 s: behind an ALTER TABLE that waits
        # for the batch, the first one waited until the batch ended (and here timed out).
        with psycopg.connect(pg_dsn, options="-c statement_timeout=5000") as writer:
            deadline = time.monotonic() + 30
            written = 0
            while (len(tries) < 3 or written < 20) and time.monotonic() < deadline:
                _write(writer, schema)
                writer.commit()
                written += 1
                time.sleep(0.02)
        assert len(tries) >= 3, f"the migration let go {len(tries)} times in 30 s"
        assert migrating.is_alive() and not _applied(pg_dsn, schema)  # it waits for the batch still
    finally:
        batch_in_flight.commit()  # the batch ends: the migration gets its lock
        migrating.join(60)
    assert [m.version for m in done[0]] == [LAST] and _applied(pg_dsn, schema)
    assert written >= 20
    assert got == [(f"schema {schema}: migration {LAST:04d}_expiry", len(tries))], got


def test_a_migration_that_never_gets_its_lock_fails_in_one_line_naming_the_transaction(
    pg_dsn: str, schema: str, batch_in_flight: psycopg.Connection[Any]
) -> None:
    holder_pid = batch_in_flight.info.backend_pid
    with psycopg.connect(pg_dsn) as conn, pytest.raises(LockWaitExpired) as caught:
        migrate(conn, schema, locks=LockWait(timeout=0.2, wait=1.0))
    message = str(caught.value)
    assert f"migration {LAST:04d}_expiry" in message and f"pid {holder_pid}" in message, message
    assert "idle in transaction" in message and "nothing of it applied" in message, message
    assert not _applied(pg_dsn, schema)
    # The command: one line when the wait starts (not one a retry), the failure in one line, exit 1.
    out = subprocess.run(
        [sys.executable, "-m", "outbox", "migrate", "--dsn", pg_dsn, "--schema", schema,
         "--lock-timeout", "0.2", "--lock-wait", "2"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1, out
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 2 and "a lock it needs is held" in lines[0], out.stderr
    assert lines[-1].startswith("outbox: error: ") and f"pid {holder_pid}" in lines[-1], out.stderr
    assert "Traceback" not in out.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "outbox", "migrate", "--dsn", pg_dsn, "--schema", schema, "--lock-wait", "-1"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().endswith("--lock-wait: must be >= 0, got -1"), (
        bad.stderr
    )
