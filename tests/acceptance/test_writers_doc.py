"""Every example in docs/writers.md runs, as a program of its own, against the real
PostgreSQL: each prints the id of an event it committed, which must be in the outbox."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from tests.stacks import url

DOC = Path(__file__).resolve().parents[2] / "docs" / "writers.md"
EXAMPLE = re.compile(r"<!-- example: (\w+) -->\n```python\n(.*?)```", re.DOTALL)
EXAMPLES = dict(EXAMPLE.findall(DOC.read_text()))


def test_the_doc_has_an_example_per_stack() -> None:
    assert sorted(EXAMPLES) == ["asyncpg", "django", "fastapi", "psycopg2"]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_writers_doc_example_commits_its_event(name: str, pg_dsn: str, schema: str, tmp_path: Path) -> None:
    program = tmp_path / f"{name}_example.py"
    program.write_text(EXAMPLES[name])
    env = {**os.environ, "DATABASE_URL": url(pg_dsn, ""), "OUTBOX_SCHEMA": schema}
    done = subprocess.run(
        [sys.executable, str(program)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    event_id = done.stdout.strip().splitlines()[-1]
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute(
            sql.SQL("SELECT topic FROM {}.events WHERE event_id = %s").format(sql.Identifier(schema)),
            (event_id,),
        ).fetchall()
    assert found == [("orders.created",)]
