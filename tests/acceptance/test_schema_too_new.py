"""A relay that finds an outbox migrated past what it knows (a newer version's ``outbox migrate``
ran) refuses that outbox in one line naming both versions, and serves the rest; alone, it exits
with that line. It never crashes."""

from __future__ import annotations

import psycopg
from psycopg import sql

from outbox import __version__
from outbox.store.migrate import migrate, migrations
from tests.helpers import FAST, ModuleProcess, count, wait_for, write_rounds

FUTURE = max(m.version for m in migrations()) + 1


def _migrate_past(dsn: str, schema: str) -> None:
    """What a newer version's migrate leaves: a migration this one does not ship."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.schema_migrations (version, name, checksum) VALUES (%s, 'future', 'x')"
            ).format(sql.Identifier(schema)),
            (FUTURE,),
        )


def test_an_outbox_migrated_past_this_version_is_refused_in_one_line_and_the_rest_served(
    pg_dsn: str, kafka: str, topic: str, prefix: str
) -> None:
    old, new = f"{prefix}_a", f"{prefix}_b"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, old)
        migrate(conn, new)
    _migrate_past(pg_dsn, new)
    write_rounds(pg_dsn, old, topic, 5, 4)
    write_rounds(pg_dsn, new, topic, 5, 4)
    relay = ModuleProcess(
        "outbox", "relay", "--dsn", pg_dsn, "--schemas", f"{prefix}_*", "--kafka-bootstrap", kafka, *FAST
    )
    with relay:
        wait_for(lambda: count(pg_dsn, old, "delivered") == 20, timeout=60, what="the outbox it knows")
        line = f"is migrated to {FUTURE:04d}, past what outbox {__version__} knows ({FUTURE - 1:04d})"
        wait_for(lambda: line in relay.output(), timeout=30, what="the refusal")
        assert count(pg_dsn, new, "events") == 20, "the outbox migrated past it was not touched"
        assert relay.stop() == 0
        lines = [text for text in relay.output().splitlines() if line in text]
        assert len(lines) == 1, lines
        assert "Traceback" not in relay.output()

    with ModuleProcess(
        "outbox", "relay", "--dsn", pg_dsn, "--schema", new, "--kafka-bootstrap", kafka
    ) as alone:
        assert alone.proc.wait(60) == 2
        out = alone.output().strip().splitlines()
    assert out == [
        f"outbox: error: --schema: '{new}' {line}: serve it from a relay of the version that migrated it"
    ]
