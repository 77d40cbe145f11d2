"""outbox.escape: untrusted text made safe for a terminal and a log line, and the log formatters
and command output that use it (issue 70: a writer's topic and a receiver's reply reached both raw)."""

from __future__ import annotations

import json
import logging

import pytest

from outbox.cli import JsonFormatter, TextFormatter
from outbox.escape import escape, escape_lines

HOSTILE = [
    ("\x1b]0;pwned\x07", "\\x1b]0;pwned\\x07"),  # the window title
    ("\x1b[2J\x1b[H", "\\x1b[2J\\x1b[H"),  # the screen cleared
    ("ok\r\n2026-12-06 INFO forged", "ok\\x0d\\x0a2026-12-06 INFO forged"),  # a forged log line
    ("\x9b31m", "\\x9b31m"),  # an 8-bit CSI
    ("abc\u202edcba", "abc\\u202edcba"),  # shown in another order than it is
    ("line\u2028sep", "line\\u2028sep"),
    ("nul\x00", "nul\\x00"),  # which PostgreSQL refuses in text
    ("\ud800", "\\ud800"),  # which no encoder takes
    ("\U000e0041", "\\U000e0041"),  # a tag character (format)
]


@pytest.mark.parametrize(("raw", "shown"), HOSTILE)
def test_every_character_a_terminal_or_log_reader_acts_on_is_written_as_an_escape(
    raw: str, shown: str
) -> None:
    assert escape(raw) == shown
    assert escape(raw).isprintable()


def test_plain_text_comes_back_as_it_is() -> None:
    for text in ("orders.created", "clé ünïcode 注文 ✓", "back\\slash", "a b", "no\u00a0break"):
        assert escape(text) == text


def _record(message: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("outbox.relay", logging.WARNING, __file__, 0, message, args, None)


def test_a_text_log_line_is_one_line_whatever_the_message_holds() -> None:
    reply = "HTTP 400 from http://hook: bad\r\n2026-12-06 12:00:00,000 ERROR outbox.relay: forged\x1b[2J"
    line = TextFormatter().format(_record("event %d dead-lettered: %s", 7, reply))
    assert "\n" not in line and "\r" not in line and "\x1b" not in line
    assert line.endswith(
        "dead-lettered: HTTP 400 from http://hook: bad\\x0d\\x0a2026-12-06 12:00:00,000 ERROR "
        "outbox.relay: forged\\x1b[2J"
    )


def test_a_traceback_follows_on_lines_of_its_own_each_indented() -> None:
    try:
        raise ValueError("bad\nINFO forged \x1b[2J")
    except ValueError:
        import sys

        record = _record("failed")
        record.exc_info = sys.exc_info()
    lines = TextFormatter().format(record).split("\n")
    assert lines[0].endswith("failed") and all(line.startswith("  ") for line in lines[1:])
    assert not any("\x1b" in line for line in lines)
    assert escape_lines("a\nb") == "  a\n  b"


def test_a_json_line_escapes_the_message_and_stays_ascii() -> None:
    line = JsonFormatter().format(_record("topic %s", "t\x9b\u202e"))
    assert line.isascii() and "\n" not in line
    assert json.loads(line)["msg"] == "topic t\\x9b\\u202e"
