"""Operating commands that change no event: migrate (and its grant check), status, notify, and the
consumer inbox's prune. Those that change events (dead letters, replay, purge) are ``cli.repair``."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox import capture, inbox
from outbox.cli import options
from outbox.cli.common import (
    add_common,
    connect,
    connect_outbox,
    dsn_of,
    schema_of,
    schema_owners,
    show,
)
from outbox.cli.outboxes import add_outboxes, choose, is_fleet
from outbox.errors import ConfigError, OutboxError
from outbox.observe.progress import Progress
from outbox.operate import archive, grants, status
from outbox.settings import setting
from outbox.sinks import claim_check
from outbox.store import lock_wait as locking
from outbox.store import migrate as migrations
from outbox.store.dsn import error_line, redact
from outbox.store.queries import query

LOCK_WAIT_SUMMARY = 30.0  # seconds between the lines of a migration still waiting for a lock


def register(sub: Any) -> None:
    p = sub.add_parser("migrate", help="create or upgrade the outbox tables")
    add_common(p)
    p.add_argument("--print", action="store_true", help="print the SQL instead of applying it")
    p.add_argument(
        "--check-grants",
        action="store_true",
        help="migrate nothing: list every role outside the trusted ones (--schema-owner, else the "
        "connecting role and the database's owner; superusers) that may CREATE in the database, in "
        "public, in the outbox's schema or in outbox_fleet, or owns a schema named after another "
        "role, and what it could do with it, and every role but the relay role (--relay-role) that may "
        "read a WAL signing key; exit 1 if there is one",
    )
    p.add_argument(
        "--inbox-only",
        action="store_true",
        help="only the consumer inbox (outbox.inbox), e.g. in a consumer's own database",
    )
    options.add(p, MigrateOptions)
    add_outboxes(p)
    p.set_defaults(run=cmd_migrate)

    p = sub.add_parser("status", help="depth, age, errors and dead letters")
    add_common(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--all",
        action="store_true",
        help="one line per outbox (--outbox, --schemas, --outboxes-file; else --dsn/--schema)",
    )
    options.add(p, StoreOption)
    add_outboxes(p)
    p.set_defaults(run=cmd_status)

    p = sub.add_parser("notify", help="switch the NOTIFY trigger on or off")
    add_common(p)
    p.add_argument("state", choices=["on", "off"])
    p.set_defaults(run=cmd_notify)

    p = sub.add_parser("inbox", help="the consumer inbox (outbox.inbox)")
    verbs = p.add_subparsers(dest="inbox_command", required=True)
    d = verbs.add_parser("prune", help="delete inbox records older than a duration, in chunks")
    add_common(d)
    d.add_argument(
        "--older-than",
        required=True,
        help="a duration, e.g. 7d: longer than any redelivery can take (broker retention, replays)",
    )
    d.add_argument("--dry-run", action="store_true", help="say how many records would go, delete nothing")
    d.set_defaults(run=cmd_inbox_prune)


@dataclass
class StoreOption:
    claim_check_store: str | None = setting(
        None,
        "the relay's claim-check store, for its bytes held (status) and its old payloads (purge)",
        default_text="postgres:",
        metavar="URL",
    )


def store_of(args: argparse.Namespace, schema: str) -> claim_check.Store:
    return claim_check.open_store(args.claim_check_store or "postgres:", dsn=dsn_of(args), schema=schema)


# -- migrate ------------------------------------------------------------------------------


@dataclass
class MigrateOptions:
    roles: bool = setting(
        False,
        "also create (if missing) and grant a writer role that can only insert events, a relay role "
        "with exactly what the relay needs, and a console role (outbox console)",
    )
    writer_role: str | None = setting(
        None, "name of the writer role; implies --roles", default_text=migrations.DEFAULT_WRITER_ROLE
    )
    relay_role: str | None = setting(
        None, "name of the relay role; implies --roles", default_text=migrations.DEFAULT_RELAY_ROLE
    )
    console_role: str | None = setting(
        None,
        "name of the console role (reads everything; redrive, skip, replay); implies --roles",
        default_text=migrations.DEFAULT_CONSOLE_ROLE,
    )
    create_roles: bool = setting(
        True, "create the roles when missing (--no-create-roles: grant to roles that already exist)"
    )
    capture: str | None = setting(
        None,
        "switch how events are captured: wal (writers emit logical decoding messages, the relay reads "
        "a replication slot; needs wal_level=logical) or table (rows in the events table)",
        choices=capture.MODES,
        default_text="unchanged (table for a new outbox)",
    )
    drop_slot: bool = setting(
        False, "with --capture table: drop the outbox's replication slot (once no writer emits to the WAL)"
    )
    lock_timeout: float = setting(
        locking.LOCK_TIMEOUT,
        "seconds a migration waits for a table's lock before it lets go and tries again: writers "
        "queue behind a waiting ALTER TABLE, so at most this long (0: wait as long as it takes)",
        metavar="SECONDS",
    )
    lock_wait: float = setting(
        locking.LOCK_WAIT,
        "seconds in all a migration tries for its locks before it fails, naming the "
        "transactions that hold locks on the outbox's tables (a relay's batch, a long report)",
        metavar="SECONDS",
    )


def _roles(args: argparse.Namespace) -> migrations.Roles | None:
    if not (args.roles or args.writer_role or args.relay_role or args.console_role or not args.create_roles):
        return None
    try:
        return migrations.Roles(
            writer=migrations.DEFAULT_WRITER_ROLE if args.writer_role is None else args.writer_role,
            relay=migrations.DEFAULT_RELAY_ROLE if args.relay_role is None else args.relay_role,
            console=migrations.DEFAULT_CONSOLE_ROLE if args.console_role is None else args.console_role,
            create=args.create_roles,
        )
    except ValueError as exc:
        raise _role_error(exc) from None


def _locks(args: argparse.Namespace) -> locking.LockWait:
    """How migrations wait for their locks (--lock-timeout, --lock-wait), said on stderr."""
    lines = _LockWaitLines(args.lock_timeout)
    try:
        return locking.LockWait(args.lock_timeout, args.lock_wait, waiting=lines.waiting, got=lines.got)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class _LockWaitLines:
    """A migration's wait for a lock on stderr: one line when it starts, one a LOCK_WAIT_SUMMARY
    while it lasts, one when the lock is got (a line a retry was forty lines in ten minutes)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.said_at = 0.0  # seconds waited when the last line was printed

    def waiting(self, what: str, tries: int, waited: float, pause: float) -> None:
        if tries == 1:
            self.said_at = waited
            _say(
                f"{what}: a lock it needs is held (an open transaction on the outbox's tables); letting "
                f"go every {self.timeout:g} s so that writers go on, and trying again until --lock-wait"
            )
        elif waited - self.said_at >= LOCK_WAIT_SUMMARY:
            self.said_at = waited
            _say(f"{what}: still waiting for its lock after {waited:.0f} s ({tries} tries)")

    def got(self, what: str, tries: int, waited: float) -> None:
        _say(f"{what}: got its lock after {waited:.0f} s ({tries + 1} tries)")


def _say(line: str) -> None:
    show(line, file=sys.stderr)


def _role_error(exc: ValueError) -> ConfigError:
    """'writer role: …' from the library as the option it came from: '--writer-role: …'."""
    return ConfigError("--" + str(exc).replace(" role: ", "-role: ", 1))


def cmd_check_grants(args: argparse.Namespace) -> int:
    """``migrate --check-grants``: the grants audit of each database the options name."""
    relay = args.relay_role or migrations.DEFAULT_RELAY_ROLE
    by_dsn: dict[str, list[str]] = {}
    for o in choose(args, every_schema=True).outboxes:
        by_dsn.setdefault(o.dsn, []).append(o.schema)
    found = 0
    for dsn, schemas in by_dsn.items():
        with connect(args, dsn) as conn:
            findings = grants.audit(conn, schemas, schema_owners(args), relay)
        where = f"{redact(dsn)}: " if len(by_dsn) > 1 else ""
        for finding in findings:
            show(where + finding.line())
        found += len(findings)
    if not found:
        show(
            "no role outside the trusted ones may create where the outbox's sessions resolve names, "
            "and none but the relay role may read a WAL signing key"
        )
    return 1 if found else 0


def cmd_migrate(args: argparse.Namespace) -> int:
    if args.check_grants:
        return cmd_check_grants(args)
    roles = _roles(args)
    if args.inbox_only and roles is not None:
        raise ConfigError("--inbox-only: the roles are the outbox's; grant the inbox to your consumer's role")
    if is_fleet(args):
        if args.print:
            raise ConfigError("--print: prints one schema's SQL (--schema), not a list of outboxes")
        return _migrate_each(args, roles)
    schema = schema_of(args)
    if args.print:
        sys.stdout.write(migrations.render_all(schema, roles, inbox_only=args.inbox_only))
        return 0
    if args.drop_slot and args.capture != "table":
        raise ConfigError("--drop-slot: only with --capture table")
    locks = _locks(args)
    with connect(args) as conn:
        applied = migrations.migrate(
            conn, schema, inbox_only=args.inbox_only, owners=schema_owners(args), locks=locks
        )
        if roles is not None:
            try:
                migrations.grant_roles(conn, schema, roles)
            except ValueError as exc:
                raise _role_error(exc) from None
            show(
                f"granted schema {schema} to writer role {roles.writer}, relay role {roles.relay} "
                f"and console role {roles.console}"
            )
    if applied:
        for m in applied:
            show(f"applied {m.version:04d}_{m.name} to schema {schema}")
    else:
        show(f"schema {schema} is up to date")
    if args.capture is not None:
        show(_switch(args, dsn_of(args), schema))
    return 0


def _switch(args: argparse.Namespace, dsn: str, schema: str) -> str:
    """Switch an outbox's capture mode (a slot is made outside any transaction: autocommit)."""
    with connect(args, dsn) as conn:
        conn.autocommit = True
        return capture.switch(conn, schema, args.capture, drop_slot=args.drop_slot)


def _migrate_each(args: argparse.Namespace, roles: migrations.Roles | None) -> int:
    """Migrate every outbox the options name, one line each; a failure is reported and the others
    go on, and any failure makes the exit code 1. One connection per database."""
    chosen = choose(args, every_schema=True)
    locks = _locks(args)
    failed = len(chosen.skipped)
    for what, why in chosen.skipped.items():
        show(f"{what}: not migrated: {why}")
    conns: dict[Any, psycopg.Connection[Any]] = {}
    used: dict[Any, int] = {}  # outboxes migrated on each database's connection
    try:
        for o in chosen.outboxes:
            try:
                conn = conns.get(o.database)
                if conn is not None and used.get(o.database, 0) >= migrations.PER_CONNECTION:
                    conn.close()
                if conn is None or conn.closed:
                    conn = conns[o.database] = connect(args, o.dsn)
                    used[o.database] = 0
                used[o.database] += 1
                applied = migrations.migrate(
                    conn, o.schema, inbox_only=args.inbox_only, owners=schema_owners(args), locks=locks
                )
                if roles is not None:
                    migrations.grant_roles(conn, o.schema, roles)
                switched = ""
                if args.capture is not None:
                    conn.commit()
                    switched = _switch(args, o.dsn, o.schema)
            except (OutboxError, ValueError, psycopg.Error) as exc:
                failed += 1
                show(f"{o.name}: failed: {error_line(exc, o.dsn)}")
                if o.database in conns and not conns[o.database].closed:
                    conns[o.database].rollback()
                continue
            done = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "up to date"
            if switched:
                done += f"; {switched.split(': ', 1)[1]}"
            granted = " (roles granted)" if roles is not None else ""
            show(f"{o.name}: schema {o.schema}: {'applied ' if applied else ''}{done}{granted}")
    finally:
        for conn in conns.values():
            conn.close()
    total = len(chosen.outboxes) + len(chosen.skipped)
    show(f"{total - failed} of {total} outboxes migrated" + (f", {failed} failed" if failed else ""))
    return 1 if failed else 0


# -- status, notify --------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    if args.all or is_fleet(args):
        return _status_all(args)
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        migrations.require_migrated(conn, schema)
        store = None if args.claim_check_store is None else store_of(args, schema)
        try:
            report = status.collect(conn, schema, store)
        finally:
            if store is not None:
                store.close()
    show(json.dumps(report) if args.json else status.render(report))
    return 0


def _status_all(args: argparse.Namespace) -> int:
    """One line per outbox (or one JSON object per outbox); an outbox that cannot be read says
    why on its line, the others are shown, and the exit code is 1."""
    chosen = choose(args)
    rows: list[dict[str, Any]] = [{"name": what, "error": why} for what, why in chosen.skipped.items()]
    conns: dict[Any, psycopg.Connection[Any]] = {}
    try:
        for o in chosen.outboxes:
            row: dict[str, Any] = {"name": o.name, "schema": o.schema}
            try:
                conn = conns.get(o.database)
                if conn is None or conn.closed:
                    conn = conns[o.database] = connect(args, o.dsn)
                conn.autocommit = True
                migrations.require_migrated(conn, o.schema, "schema")
                row.update(status.summary(conn, o.schema))
            except (OutboxError, psycopg.Error) as exc:
                row["error"] = error_line(exc, o.dsn)
            rows.append(row)
    finally:
        for conn in conns.values():
            conn.close()
    rows.sort(key=lambda r: str(r["name"]))
    show(json.dumps({"outboxes": rows}) if args.json else status.render_summaries(rows))
    return 1 if any("error" in r for r in rows) else 0


def cmd_notify(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        conn.execute(
            query("notify_trigger", schema, keywords={"state": "ENABLE" if args.state == "on" else "DISABLE"})
        )
    show(f"NOTIFY on insert is {args.state} for schema {schema}")
    return 0


# -- dead letters ------------------------------------------------------------------------------


# -- inbox ------------------------------------------------------------------------------------


def cmd_inbox_prune(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    age = archive.parse_duration(args.older_than, "--older-than")
    with connect_outbox(args) as conn:
        conn.autocommit = True
        row = conn.execute(query("inbox_table", schema), (schema,)).fetchone()
        if not row or not row[0]:
            raise ConfigError(f"--schema: {schema!r} holds no inbox; run `outbox migrate --inbox-only`")
        total = inbox.count_older(conn, age, schema=schema)
        if args.dry_run:
            show(f"would delete {total} inbox records older than {args.older_than}")
            return 0
        progress = Progress("inbox prune", max(total, 1), " records")
        deleted = inbox.prune(conn, age, schema=schema, progress=progress.update)
        progress.close()
    show(f"deleted {deleted} inbox records older than {args.older_than}")
    return 0
