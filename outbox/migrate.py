"""Migrations: plain SQL files in ``migrations/``, applied in order, recorded.

Each file ``NNNN_name.sql`` runs in its own transaction together with the row
that records it in ``<schema>.schema_migrations``, under an advisory lock so
that relays starting side by side do not race. ``render_all`` produces the same
SQL as one script for teams that run migrations with their own tool.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from outbox.schema import DEFAULT_SCHEMA, channel_name, validate_schema

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def render(self, schema: str) -> sql.Composed:
        return sql.SQL(self.text).format(
            schema=sql.Identifier(schema),
            schema_name=sql.Literal(schema),
            channel=sql.Literal(channel_name(schema)),
        )


def migrations() -> list[Migration]:
    """Every migration shipped with the package, in order."""
    found = []
    for entry in importlib.resources.files("outbox.migrations").iterdir():
        m = _FILE.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions: {versions}")
    return found


_PREAMBLE = """\
CREATE SCHEMA IF NOT EXISTS {schema};
CREATE TABLE IF NOT EXISTS {schema}.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    checksum   text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)"""

_RECORD = "INSERT INTO {schema}.schema_migrations (version, name, checksum) VALUES ({v}, {n}, {c})"


def _preamble(schema: str) -> sql.Composed:
    return sql.SQL(_PREAMBLE).format(schema=sql.Identifier(schema))


def _record(schema: str, m: Migration) -> sql.Composed:
    return sql.SQL(_RECORD).format(
        schema=sql.Identifier(schema),
        v=sql.Literal(m.version),
        n=sql.Literal(m.name),
        c=sql.Literal(m.checksum),
    )


def render_all(schema: str = DEFAULT_SCHEMA) -> str:
    """All migrations as one SQL script, exactly what ``migrate`` applies."""
    validate_schema(schema)
    parts = [
        "-- outbox migrations for schema " + sql.Identifier(schema).as_string(),
        "BEGIN;",
        _preamble(schema).as_string() + ";",
    ]
    for m in migrations():
        parts.append(f"\n-- migration {m.version:04d}_{m.name}")
        parts.append(m.render(schema).as_string().rstrip())
        parts.append(_record(schema, m).as_string() + ";")
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


def _lock_key(schema: str) -> int:
    digest = hashlib.sha256(("outbox-migrate:" + schema).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def applied_versions(conn: psycopg.Connection[Any], schema: str) -> dict[int, str]:
    """Versions recorded in ``schema`` (empty when it was never migrated)."""
    row = conn.execute("SELECT to_regclass(format('%%I.schema_migrations', %s::text))", (schema,)).fetchone()
    if not row or row[0] is None:
        return {}
    rows = conn.execute(
        sql.SQL("SELECT version, checksum FROM {}.schema_migrations").format(sql.Identifier(schema))
    ).fetchall()
    return {int(v): str(c) for v, c in rows}


def migrate(conn: psycopg.Connection[Any], schema: str = DEFAULT_SCHEMA) -> list[Migration]:
    """Apply the migrations ``schema`` lacks; return them. Safe to run again and concurrently."""
    validate_schema(schema)
    applied: list[Migration] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(schema),))
        conn.execute(_preamble(schema))
    for m in migrations():
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_lock_key(schema),))
            done = applied_versions(conn, schema)
            if m.version in done:
                if done[m.version] != m.checksum:
                    raise RuntimeError(
                        f"migration {m.version:04d}_{m.name} was applied to schema {schema!r} "
                        "with different content; migrations must never be edited once released"
                    )
                continue
            conn.execute(m.render(schema))
            conn.execute(_record(schema, m))
            applied.append(m)
    return applied
