"""outbox.queries: named SQL, loaded once, schema bound as an identifier (pure)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from outbox.store import queries

PACKAGE = Path(queries.__file__).parents[1]  # outbox/


def test_int_arrays_as_literals() -> None:
    assert queries.int_array([1, None, 3]) == "{1,NULL,3}"
    assert queries.int_array([]) == "{}"
    assert queries.int_array([7, -2, 10**12]) == "{7,-2,1000000000000}"  # no NULL: the map(str) path
    assert queries.int_array(iter([None, 5])) == "{NULL,5}"  # any iterable, read once


def test_every_named_query_binds_its_placeholders() -> None:
    fillers = {
        "keywords": {"state": "ENABLE"},
        "fragments": {"limits": "claim_limits", "skips": "claim_skips"},
        "identifiers": {
            "partition": "delivered_p20260101",
            "role": "r",
            "relay": "r",
            "table": "events",
            "publication": "p",
            "database": "d",
        },
        "literals": {
            "version": 1,
            "name": "n",
            "checksum": "c",
            "body": "b",
            "statement": "s",
            "relay_name": "r",
            "password": "p",
            "since": "a",
            "until": "b",
        },
    }
    for name in queries.names():
        text = queries.query(name, 'we"ird', **fillers).as_string()  # type: ignore[arg-type]
        assert not re.search(r"(?<!\{)\{[a-z_]+\}(?!\})", text), (name, text)  # no placeholder left
    with pytest.raises(KeyError):
        queries.query("nope", "outbox")


def test_no_runtime_module_writes_sql_by_hand() -> None:
    """SQL lives in .sql files: no module of the package executes or composes a string literal."""
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            first = node.args[0]
            literal = isinstance(first, (ast.Constant, ast.JoinedStr)) and not (
                isinstance(first, ast.Constant) and not isinstance(first.value, str)
            )
            if name in ("execute", "executemany", "copy", "SQL") and literal:
                offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_no_statement_is_defined_twice() -> None:
    bodies: dict[str, str] = {}
    for name in queries.names():
        body = " ".join(queries.raw(name).split())
        assert body not in bodies, f"{name} repeats {bodies.get(body)}"
        bodies[body] = name


# SQL syntax that looks like a call but is no function of pg_catalog's (a FROM list's ROWS FROM,
# ARRAY(subquery), a VALUES row, an INSERT's column list, a CTE's or alias's column list).
_NOT_CALLS = {"array", "values", "from", "coalesce", "nullif", "exists", "any", "in", "as", "events", "inbox",
              "claim_checks", "conflict", "x", "emit_events", "ordinality", "rows", "stdin", "using"}  # fmt: skip


def test_statements_on_an_applications_session_name_pg_catalogs_functions_in_full() -> None:
    """A writer's, an inbox's or a claim-check fetch's statement runs on a session whose search_path
    the project does not pin: an unqualified call there resolves in "$user" and public first,
    where another role may have planted an overload (tests/traps.py). Every call is pg_catalog's by
    its full name (or the outbox's own, by its schema)."""
    assert set(queries.names()) >= queries.APPLICATION_SESSION, "a name in APPLICATION_SESSION is unknown"
    unqualified = {}
    for name in sorted(queries.APPLICATION_SESSION):
        text = queries.raw(name)
        text = re.sub(r"'(?:[^']|'')*'", "''", text)  # literals
        calls = re.findall(r"(?<![\w.\"])([A-Za-z_]\w*)\s*\(", text)
        bare = sorted({c for c in calls if c.lower() not in _NOT_CALLS})
        if bare:
            unqualified[name] = bare
    assert unqualified == {}, unqualified


def test_the_grants_audit_trusts_exactly_whom_the_schema_check_trusts() -> None:
    """Two statements name the trusted roles (a CTE cannot be shared between named statements):
    the schema check that refuses an outbox, and the grants audit that lists who else may create.
    They must never disagree."""

    def trusted(name: str) -> str:
        text = queries.raw(name)
        start = text.index("trusted AS (")
        return " ".join(text[start : text.index("), ", start)].split())

    assert trusted("grants_audit") == trusted("untrusted_schemas")


def test_a_statement_is_rendered_once_per_encoding_and_as_psycopg_renders_it() -> None:
    from psycopg import sql

    statement = queries.query("archive_delivered", "my schema")
    plain = sql.SQL(queries.raw("archive_delivered")).format(
        schema=sql.Identifier("my schema"),
        schema_name=sql.Literal("my schema"),
        channel=sql.Literal("my schema_events"),
    )
    assert statement.as_bytes(None) == plain.as_bytes(None)
    assert statement.as_bytes(None) is statement.as_bytes(None)  # kept, not rendered again
    assert statement.as_string(None) == plain.as_string(None)
