"""Migrations: idempotent, and `--print` is exactly what `migrate` applies."""

from __future__ import annotations

import subprocess
import sys
import uuid

import psycopg
from psycopg import sql

from outbox.store.migrate import migrate, migrations, render_all
from tests.helpers import catalog as _catalog


def test_migrate_twice_is_a_no_op(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        before = _catalog(conn, schema)
        assert migrate(conn, schema) == []
        assert _catalog(conn, schema) == before
        assert [v for v, *_ in before["versions"]] == [m.version for m in migrations()]


def test_printed_sql_matches_what_migrate_applies(pg_dsn: str, schema: str) -> None:
    printed_schema = f"p_{uuid.uuid4().hex[:12]}"
    out = subprocess.run(
        [sys.executable, "-m", "outbox", "migrate", "--print", "--schema", printed_schema],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == render_all(printed_schema)
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        try:
            conn.execute(out.encode())  # what a team's own migration tool would run
            assert _catalog(conn, printed_schema) == _catalog(conn, schema)
            assert migrate(conn, printed_schema) == []  # recorded versions are honoured
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(printed_schema)))


def test_cli_migrate_applies_then_reports_up_to_date(pg_dsn: str) -> None:
    name = f"c_{uuid.uuid4().hex[:12]}"
    cmd = [sys.executable, "-m", "outbox", "migrate", "--dsn", pg_dsn, "--schema", name]
    try:
        first = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        second = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        assert "applied 0001_initial" in first
        assert "up to date" in second
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_schema_names_are_identifiers_not_sql(pg_dsn: str) -> None:
    name = 'x"; DROP TABLE y; --'
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        try:
            migrate(conn, name)
            row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (name,)).fetchone()
            assert row == (1,)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))


def test_migrate_print_cannot_be_made_to_emit_sql_by_a_name_with_a_line_break(
    pg_dsn: str, prefix: str
) -> None:
    """A schema or role name with a line break would end the comment that names it in the
    printed script, and the rest of the line would run as SQL where a team runs the script.
    Refused in one line, naming the option; nothing printed, so nothing for a tool to run."""
    canary = f"{prefix}_canary"
    injected = f'x\nDROP SCHEMA "{canary}" CASCADE; --'
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(canary)))
        for args in (["--schema", injected], ["--writer-role", injected, "--relay-role", "r"]):
            out = subprocess.run(
                [sys.executable, "-m", "outbox", "migrate", "--print", *args],
                capture_output=True,
                text=True,
            )
            assert out.returncode == 2 and out.stdout == "", out.stdout[-500:]
            assert out.stderr.count("\n") == 1 and "must be printable text" in out.stderr, out.stderr
            assert out.stderr.startswith(f"outbox: error: {args[0]}: "), out.stderr
            if out.stdout:  # what a team's own migration tool would run
                conn.execute(out.stdout.encode())
        row = conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = %s", (canary,)).fetchone()
        assert row == (1,), "the printed script dropped the canary schema"
