"""The ``outbox`` command line.

Every option can also be set through the ``OUTBOX_*`` environment variable
shown in its help; the DSN falls back to libpq's ``PG*`` variables when
neither ``--dsn`` nor ``OUTBOX_DSN`` is set. Options are made from the
settings they configure (``outbox.cli.options``), so they are declared once.

Each command group registers itself: ``cli.relay`` (relay), ``cli.operate``
(migrate, status, notify, inbox), ``cli.repair`` (dead, retry, replay, purge, audit),
``cli.demo`` (demo, dev), ``cli.console`` (console), ``cli.verify`` (verify). Another
distribution adds commands through the ``outbox.commands`` entry points: ``outbox-relay-bench``
adds ``bench`` (:data:`PLUGINS`). An expected error (:class:`~outbox.errors.OutboxError`) is one
line on stderr and an exit code; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import Any, NoReturn

import psycopg

from outbox import __version__
from outbox.cli.common import BENCH_HELP
from outbox.errors import OutboxError
from outbox.escape import escape, escape_lines
from outbox.store.dsn import scrub, secrets_in_argv, secrets_of

log = logging.getLogger("outbox")

Command = Callable[[argparse.Namespace], int]

_parsing: list[str] = []  # the arguments main() is parsing (they may not be sys.argv)


class Parser(argparse.ArgumentParser):
    """argparse echoes arguments in its errors ("unrecognized arguments: ..."):
    scrub any password in them first. Sub-parsers inherit this class."""

    def error(self, message: str) -> NoReturn:
        super().error(scrub(message, secrets_in_argv([*sys.argv[1:], *_parsing])))


# The structured fields a line may carry (``extra=``), kept in JSON lines: ``event``, a stable name
# for tools (the message may be reworded); ``outbox``, which outbox (a relay serving several): its
# name, never a DSN; ``batch_age``, how long a batch lost or rolled back had been out (seconds:
# every event of it was sent within that time; the schedule explorer's checker reads it).
_LOG_FIELDS = ("event", "outbox", "batch_age")


def _detail(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """A record's lines beyond its message: its traceback (``exc_info``, or a scrubbed one given
    as ``extra={"detail": ...}``), or None."""
    detail = getattr(record, "detail", None)
    if detail is None and record.exc_info:
        detail = formatter.formatException(record.exc_info)
    return None if detail is None else str(detail)


class JsonFormatter(logging.Formatter):
    """One JSON object a line; the message escaped (outbox.escape) as in text lines."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": escape(record.getMessage()),
        }
        for field in _LOG_FIELDS:
            value = getattr(record, field, None)
            if value is not None:
                entry[field] = escape(value) if isinstance(value, str) else value
        detail = _detail(self, record)
        if detail is not None:
            entry["exc"] = detail
        return json.dumps(entry, ensure_ascii=True)


class TextFormatter(logging.Formatter):
    """``time level logger: message``, one line a record: the message is escaped (outbox.escape),
    so that a writer's topic or a receiver's reply with a line break cannot forge a line; a
    traceback follows on lines of its own, each escaped and indented."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        record.message = escape(record.getMessage())
        record.asctime = self.formatTime(record, self.datefmt)
        line = self.formatMessage(record)
        detail = _detail(self, record)
        return line if detail is None else line + "\n" + escape_lines(detail.rstrip("\n"))


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # botocore says at INFO which source gave the credentials, once per client made (the AWS
    # sinks make one per connection): noise beside the relay's own lines. Its warnings stay.
    # httpx (httpx2 in Starlette's test client, which times the console's pages in the bench)
    # logs every request at INFO: a line per request in the middle of the bench's progress.
    for name in ("botocore.credentials", "aiobotocore.credentials", "httpx", "httpx2"):
        logging.getLogger(name).setLevel(max(logging.WARNING, root.level))


# Which module registers each command: a command line that names one builds that module's
# parser alone, and imports no other command's (``outbox status`` imports neither the relay nor
# the console). Anything else (no command, --help, a misspelt one) builds them all.
GROUPS: dict[str, str] = {
    "migrate": "operate", "status": "operate", "notify": "operate", "inbox": "operate",
    "dead": "repair", "retry": "repair", "replay": "repair", "purge": "repair", "audit": "repair",
    "capture": "capture", "transform": "transform", "relay": "relay", "demo": "demo", "dev": "demo",
    "console": "console", "verify": "verify",
}  # fmt: skip
# Commands of other distributions, each an ``outbox.commands`` entry point (``register(sub)``),
# and what installs it: the bench, the fault suite and the explorer are not in outbox-relay.
PLUGINS: dict[str, tuple[str, str]] = {
    "bench": (BENCH_HELP, "pip install outbox-relay-bench (from a clone: pip install -e ./benchmarks)"),
}
ENTRY_POINTS = "outbox.commands"


@functools.cache
def _plugin(name: str) -> Callable[[Any], None] | None:
    """The ``register`` of the installed distribution that adds command ``name``, or None."""
    for entry in entry_points(group=ENTRY_POINTS, name=name):
        register: Callable[[Any], None] = entry.load()
        return register
    return None


def build_parser(*, bench: bool = True, command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; ``bench=False`` leaves the other distributions' commands out (a line
    in the list of commands stands for each), so that no other command looks for them or imports
    them. ``command``: only the group that registers it (see :data:`GROUPS`), when it names one."""
    parser = Parser(
        prog="outbox",
        description="Transactional outbox relay: PostgreSQL outbox table -> Kafka, RabbitMQ, NATS, "
        "Redis Streams, webhooks, AWS (SQS, SNS, EventBridge, Kinesis). "
        "Every option can also be set with the OUTBOX_* variable named in its help.",
    )
    parser.add_argument("--version", action="version", version=f"outbox {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    group = GROUPS.get(command or "")
    for name in (group,) if group else dict.fromkeys(GROUPS.values()):  # each module once, in order
        importlib.import_module(f"outbox.cli.{name}").register(sub)
    if group:
        return parser
    for name, (help_, _) in PLUGINS.items():
        register = _plugin(name) if bench else None
        if register is None:
            sub.add_parser(name, help=help_, add_help=False)  # its help line alone
        else:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        _parsing[:] = list(argv) if argv is not None else []
        given = list(argv) if argv is not None else sys.argv[1:]
        first = given[0] if given else None
        if first in PLUGINS and _plugin(first) is None:  # whatever its arguments
            print(f"outbox: error: `outbox {first}` is not installed: {PLUGINS[first][1]}", file=sys.stderr)
            return 2
        args = build_parser(bench=first in PLUGINS, command=first).parse_args(argv)
        setup_logging(args.log_format, args.log_level)
        command: Command = args.run
        return command(args)
    except OutboxError as exc:
        print(f"outbox: error: {escape(_scrub(str(exc)))}", file=sys.stderr)
        return exc.exit_code
    except psycopg.Error as exc:
        print(f"outbox: database error: {escape(_scrub(str(exc).strip()))}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _scrub(text: str) -> str:
    secrets = secrets_of(os.environ.get("OUTBOX_DSN", "")) + secrets_in_argv([*sys.argv[1:], *_parsing])
    return scrub(text, secrets)
