"""What every command shares: the connection options, logging options, and a few helpers."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.cli import options
from outbox.errors import Cancelled, ConfigError
from outbox.escape import escape
from outbox.events import key_bytes
from outbox.settings import setting
from outbox.store import pinning
from outbox.store.dsn import redact, scrub, secrets_of
from outbox.store.pooling import COMMANDS_NEED, require_own_sessions
from outbox.store.schema import DEFAULT_SCHEMA, FLEET_SCHEMA, validate_schema
from outbox.store.trust import require_trusted

BENCH_HELP = "benchmark the relay against baselines (tables and plots), or run the fault suite"
LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class Common:
    dsn: list[str] = setting(
        default_factory=list,
        help="PostgreSQL connection string; else libpq's PG* variables (relay, migrate and status take "
        "several, with --schemas)",
    )
    schema: str = setting(DEFAULT_SCHEMA, "schema of the outbox tables")


@dataclass
class Logs:
    log_format: str = setting("text", "log line format", choices=LOG_FORMATS)
    log_level: str = setting("info", "log level", choices=LOG_LEVELS)


def add_common(parser: argparse.ArgumentParser) -> None:
    """The connection's options and the logs'."""
    options.add(parser, Common)
    options.add(parser, Logs)


def add_logs(parser: argparse.ArgumentParser) -> None:
    """The logs' options alone (a command that connects to no outbox)."""
    options.add(parser, Logs)


def schema_of(args: argparse.Namespace) -> str:
    return validate_schema(args.schema, "--schema")


def dsn_of(args: argparse.Namespace) -> str:
    """The one --dsn of a command that works on one database ("" leaves it to libpq's PG*)."""
    given: list[str] = args.dsn or []
    if len(given) > 1:
        raise ConfigError(
            f"--dsn: given {len(given)} times; only one database here (several go with --schemas)"
        )
    return given[0] if given else ""


def connect(args: argparse.Namespace, dsn: str | None = None) -> psycopg.Connection[Any]:
    """A connection for a command (to ``dsn``, else its --dsn), or a one-line error naming the
    (redacted) DSN."""
    dsn = dsn_of(args) if dsn is None else dsn
    # Its search_path is pinned for the session: not through a pooler that hands the session on.
    require_own_sessions(dsn, f"outbox {getattr(args, 'command', '')}".strip(), COMMANDS_NEED)
    try:
        return pinning.connect(dsn, application_name="outbox-cli")
    except psycopg.OperationalError as exc:
        raise ConfigError(
            f"cannot connect to PostgreSQL ({redact(dsn)}): {scrub(str(exc), secrets_of(dsn))}"
        ) from None


def schema_owners(args: argparse.Namespace) -> list[str]:
    """The --schema-owner roles (the variable's split on whitespace), for commands that take it."""
    return [name for item in getattr(args, "schema_owner", None) or [] for name in item.split()]


def connect_outbox(args: argparse.Namespace) -> psycopg.Connection[Any]:
    """A connection for a command on the outbox of --dsn/--schema, once that schema and the
    database's outbox_fleet are trusted (:mod:`outbox.store.trust`): the command's statements may run
    code kept there (a trigger, a view), with the rights of whoever runs the command."""
    conn = connect(args)
    try:
        who = f"outbox {getattr(args, 'command', '')}".strip()
        require_trusted(conn, [schema_of(args), FLEET_SCHEMA], schema_owners(args), runs_as=who)
        conn.commit()
    except BaseException:
        conn.close()
        raise
    return conn


def confirm(args: argparse.Namespace, question: str) -> None:
    """Ask before a destructive change, unless --yes; refuse when there is nobody to ask."""
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise Cancelled(f"{question}: pass --yes to confirm (there is no terminal to ask)")
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise Cancelled("cancelled")


def add_confirm(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--dry-run", action="store_true", help=f"say what {what} would change, change nothing"
    )
    parser.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def key_arg(key: str | None) -> bytes | None:
    """A ``--key`` value: UTF-8 text, or ``0x…`` for bytes."""
    return key_bytes(key, "--key")


def show(text: str, *, file: Any = None) -> None:
    """Print a command's output, each line escaped (:func:`outbox.escape.escape`): what commands
    show holds writers' topics and keys, receivers' replies and other roles' names, and none of it
    may reach the operator's terminal as an escape sequence or a line of its own."""
    print("\n".join(map(escape, text.split("\n"))), file=file or sys.stdout, flush=file is not None)
