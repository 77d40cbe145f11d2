"""The core package imports no optional stack: an app on psycopg 3 alone never loads
psycopg2, asyncpg, SQLAlchemy or Django (nor pays their import time)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.same_on_every_python


def test_importing_outbox_and_enqueueing_loads_no_optional_stack() -> None:
    code = (
        "import sys, outbox, outbox.write.stacks, outbox.write.writer, outbox.relay.relay, outbox.cli\n"
        "loaded = sorted(m for m in ('psycopg2', 'asyncpg', 'sqlalchemy', 'django', 'alembic') if m in sys.modules)\n"
        "print(loaded)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
