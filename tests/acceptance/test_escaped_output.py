"""Untrusted text never reaches the operator's terminal or the relay's log raw (issue 70, finding 5):
a trap over every command that shows events, and the relay's own log.

Writers' topics, keys and headers hold escape sequences (a window title, a cleared screen, lines
overwritten), a webhook receiver refuses with a body that holds a CR/LF and a forged log line, and
a transform fails with a writer's payload as its message. The relay runs as a process with text
logs; then every command that shows events, dead letters, errors or names runs against what it
left. No line of any of them holds a character :func:`outbox.escape.escape` would escape, and every
line of the log starts with its time (or is an indented continuation): none was forged.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator

import psycopg
import pytest
from outbox_bench.harness.sinktaps import Receiver, Request
from psycopg import sql

import outbox
from outbox.escape import escape
from tests.helpers import ModuleProcess, count, wait_for

TITLE = "\x1b]0;pwned\x07"
CLEAR = "\x1b[2J\x1b[H"
FORGED = "\r\n2026-12-06 12:00:00,000 ERROR outbox.relay: forged line\x1b[2K"
LINE_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} [A-Z]+ |  ")


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    def answer(request: Request) -> tuple[int, dict[str, str], bytes]:
        if "/reject/" in request.path:
            return 400, {}, ("refused: " + FORGED + CLEAR + "\x00\x9b31m").encode()
        if "/later/" in request.path:
            return 503, {}, ("busy" + FORGED + TITLE).encode()
        return 204, {}, b""

    r = Receiver(respond=answer)
    yield r
    r.close()


def _clean(text: str) -> list[str]:
    """The lines of ``text`` that hold a character escape() would escape (none, if it is safe)."""
    return [line for line in text.split("\n") if escape(line) != line]


def _outbox(args: list[str]) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "outbox", *args], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode in (0, 1), (args, out.returncode, out.stderr[-2000:])
    return out.stdout + out.stderr


def test_no_command_and_no_log_line_shows_a_writers_or_a_receivers_text_raw(
    pg_dsn: str, schema: str, kafka: str, receiver: Receiver, topic: str
) -> None:
    hook = f"http://127.0.0.1:{receiver.port}"
    with psycopg.connect(pg_dsn) as conn:
        # Kafka refuses the topic for good: a dead letter whose topic, key and reason hold escapes.
        outbox.enqueue(conn, f"t{TITLE}", b"x", key=f"k{CLEAR}", schema=schema)
        outbox.enqueue(conn, "hook.reject", b"x", key=f"red\x1b[31m{FORGED}", schema=schema)
        outbox.enqueue(conn, "hook.later", b"x", key="later", schema=schema)
        outbox.enqueue(conn, "xf.fail", f"cannot{FORGED}{TITLE}".encode(), schema=schema)
        outbox.enqueue(
            conn, topic, f"delivered{CLEAR}".encode(), key=f"ok{TITLE}", headers={"x-note": f"n{FORGED}"},
            schema=schema,
        )  # fmt: skip
    relay = ModuleProcess(
        "outbox", "relay", "--dsn", pg_dsn, "--schema", schema, "--kafka-bootstrap", kafka,
        "--route", f"hook.reject={hook}/reject/{{topic}}", "--route", f"hook.later={hook}/later/{{topic}}",
        "--transform", "xf.*=tests.transforms:fail_with_payload", "--poll-interval", "0.1",
        "--retry-base", "60", "--log-format", "text", "--log-level", "debug",
    )  # fmt: skip
    with relay:
        wait_for(lambda: count(pg_dsn, schema, "dead_letters") == 3, timeout=30, what="the dead letters")
        wait_for(lambda: count(pg_dsn, schema, "events", "attempts > 0") == 1, timeout=30, what="the retry")
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 1, timeout=30, what="the delivery")
        relay.stop()
        log = relay.output()
    assert "dead-lettered" in log and "forged line" in log
    assert not _clean(log), _clean(log)
    for line in filter(None, log.split("\n")):
        assert LINE_START.match(line), f"a line the relay did not start: {line!r}"

    # Another role's name is untrusted text too: one that may create in the database is named by
    # --check-grants.
    hostile_role = f"r{TITLE}{CLEAR}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {}").format(sql.Identifier(hostile_role)))
        database = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        conn.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                *map(sql.Identifier, (database, hostile_role))
            )
        )
    common = ["--dsn", pg_dsn, "--schema", schema]
    commands: list[list[str]] = [
        ["status", *common],
        ["status", *common, "--json"],
        ["status", "--dsn", pg_dsn, "--schemas", schema, "--all"],
        ["dead", "list", *common],
        ["dead", "list", *common, "--json"],
        ["dead", "redrive", *common, "--all", "--dry-run"],
        ["dead", "skip", *common, "--all", "--dry-run"],
        ["retry", *common, "--dry-run"],
        ["replay", *common, "--since", "1h", "--dry-run"],
        ["transform", "test", "*=tests.transforms:fail_with_payload", *common, "--last", "10"],
        ["transform", "test", "*=tests.transforms:noop", *common, "--last", "10"],
        ["audit", *common],
        ["verify", *common, "--since", "1h", "--route", "*=amqp://127.0.0.1:1/"],
        ["dead", "list", *common, "--topic", f"t{TITLE}"],  # an operator's own argument echoed
        ["migrate", *common, "--check-grants"],
    ]
    shown = []
    try:
        for args in commands:
            out = _outbox(args)
            shown.append(out)
            assert not _clean(out), (args, _clean(out))
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(hostile_role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(hostile_role)))
    dead_list, status = shown[3], shown[0]
    assert "r\\x1b]0;pwned\\x07" in shown[-1], shown[-1]
    assert "t\\x1b]0;pwned\\x07" in dead_list and "k\\x1b[2J" in dead_list, dead_list
    assert "busy\\x0d\\x0a2026-12-06" in status, status  # the retry's error, one line
