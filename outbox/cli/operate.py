"""Operating commands: migrate, status, notify, dead letters (list/redrive/skip, retry), replay, purge,
inbox prune, and the audit trail of those that change events."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox import capture, inbox
from outbox.cli import options
from outbox.cli.common import (
    add_common,
    add_confirm,
    confirm,
    connect,
    connect_outbox,
    dsn_of,
    key_arg,
    schema_of,
    schema_owners,
)
from outbox.cli.outboxes import add_outboxes, choose, is_fleet
from outbox.errors import ConfigError, NothingMatched, OutboxError
from outbox.observe.progress import Progress
from outbox.operate import archive, audit, dead, grants, status
from outbox.settings import setting
from outbox.sinks import claim_check
from outbox.store import migrate as migrations
from outbox.store.dsn import error_line, redact
from outbox.store.queries import query


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
        "role, and what it could do with it; exit 1 if there is one",
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

    p = sub.add_parser("dead", help="list, redrive or skip dead letters (parked keys)")
    verbs = p.add_subparsers(dest="dead_command", required=True)
    d = verbs.add_parser("list", help="dead letters with the events parked behind them")
    _add_selector(d)
    d.add_argument("--limit", type=int, default=100, help="at most this many [default 100]")
    d.add_argument("--json", action="store_true", help="print one JSON array")
    d.set_defaults(run=cmd_dead_list, everything_unless_filtered=True)
    d = verbs.add_parser(
        "redrive", help="put dead letters back at the head of their key; parked events follow in order"
    )
    _add_selector(d, confirm_what="the redrive")
    _add_unverified(d)
    d.set_defaults(run=cmd_redrive, verb="redrive", everything_unless_filtered=False)
    d = verbs.add_parser("skip", help="give dead letters up and release the events parked behind them")
    _add_selector(d, confirm_what="the skip")
    d.set_defaults(run=cmd_skip, everything_unless_filtered=False)

    p = sub.add_parser(
        "retry", help="put dead letters back into the outbox: `dead redrive`, every one unless filtered"
    )
    _add_selector(p, confirm_what="the retry")
    _add_unverified(p)
    p.set_defaults(run=cmd_redrive, verb="retry", everything_unless_filtered=True)

    p = sub.add_parser("replay", help="re-send archived events delivered in a time window")
    add_common(p)
    p.add_argument("--since", required=True, help="ISO time (UTC if no zone) or a duration ago, e.g. 2h")
    p.add_argument("--until", default=None, help="ISO time or a duration ago [default: now]")
    p.add_argument("--topic", help="only events of this topic")
    p.add_argument("--key", help="only events of this key (UTF-8 text, or 0x... for bytes)")
    p.add_argument(
        "--upto",
        type=int,
        metavar="ID",
        help="only archived events up to this id (what a console preview counted)",
    )
    add_confirm(p, "the replay")
    p.set_defaults(run=cmd_replay)

    p = sub.add_parser(
        "purge",
        help="drop archive partitions older than a duration, and the claim-check payloads of those days",
    )
    add_common(p)
    options.add(p, StoreOption)
    p.add_argument("--older-than", required=True, help="a duration, e.g. 30d, 12h")
    add_confirm(p, "the purge")
    p.set_defaults(run=cmd_purge)

    p = sub.add_parser("audit", help="who redrove, skipped, replayed or purged what, and when")
    add_common(p)
    p.add_argument("--limit", type=int, default=50, help="the latest this many [default 50]")
    p.add_argument("--json", action="store_true", help="print one JSON array")
    p.set_defaults(run=cmd_audit)

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


def _store(args: argparse.Namespace, schema: str) -> claim_check.Store:
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


def _role_error(exc: ValueError) -> ConfigError:
    """'writer role: …' from the library as the option it came from: '--writer-role: …'."""
    return ConfigError("--" + str(exc).replace(" role: ", "-role: ", 1))


def cmd_check_grants(args: argparse.Namespace) -> int:
    """``migrate --check-grants``: the grants audit of each database the options name."""
    by_dsn: dict[str, list[str]] = {}
    for o in choose(args, every_schema=True).outboxes:
        by_dsn.setdefault(o.dsn, []).append(o.schema)
    found = 0
    for dsn, schemas in by_dsn.items():
        with connect(args, dsn) as conn:
            findings = grants.audit(conn, schemas, schema_owners(args))
        where = f"{redact(dsn)}: " if len(by_dsn) > 1 else ""
        for finding in findings:
            print(where + finding.line())
        found += len(findings)
    if not found:
        print("no role outside the trusted ones may create where the outbox's sessions resolve names")
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
    with connect(args) as conn:
        applied = migrations.migrate(conn, schema, inbox_only=args.inbox_only, owners=schema_owners(args))
        if roles is not None:
            try:
                migrations.grant_roles(conn, schema, roles)
            except ValueError as exc:
                raise _role_error(exc) from None
            print(
                f"granted schema {schema} to writer role {roles.writer}, relay role {roles.relay} "
                f"and console role {roles.console}"
            )
    if applied:
        for m in applied:
            print(f"applied {m.version:04d}_{m.name} to schema {schema}")
    else:
        print(f"schema {schema} is up to date")
    if args.capture is not None:
        print(_switch(args, dsn_of(args), schema))
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
    failed = len(chosen.skipped)
    for what, why in chosen.skipped.items():
        print(f"{what}: not migrated: {why}")
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
                    conn, o.schema, inbox_only=args.inbox_only, owners=schema_owners(args)
                )
                if roles is not None:
                    migrations.grant_roles(conn, o.schema, roles)
                switched = ""
                if args.capture is not None:
                    conn.commit()
                    switched = _switch(args, o.dsn, o.schema)
            except (OutboxError, ValueError, psycopg.Error) as exc:
                failed += 1
                print(f"{o.name}: failed: {error_line(exc, o.dsn)}")
                if o.database in conns and not conns[o.database].closed:
                    conns[o.database].rollback()
                continue
            done = ", ".join(f"{m.version:04d}_{m.name}" for m in applied) or "up to date"
            if switched:
                done += f"; {switched.split(': ', 1)[1]}"
            granted = " (roles granted)" if roles is not None else ""
            print(f"{o.name}: schema {o.schema}: {'applied ' if applied else ''}{done}{granted}")
    finally:
        for conn in conns.values():
            conn.close()
    total = len(chosen.outboxes) + len(chosen.skipped)
    print(f"{total - failed} of {total} outboxes migrated" + (f", {failed} failed" if failed else ""))
    return 1 if failed else 0


# -- status, notify --------------------------------------------------------------------------


def cmd_status(args: argparse.Namespace) -> int:
    if args.all or is_fleet(args):
        return _status_all(args)
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        migrations.require_migrated(conn, schema)
        store = None if args.claim_check_store is None else _store(args, schema)
        try:
            report = status.collect(conn, schema, store)
        finally:
            if store is not None:
                store.close()
    print(json.dumps(report) if args.json else status.render(report))
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
    print(json.dumps({"outboxes": rows}) if args.json else status.render_summaries(rows))
    return 1 if any("error" in r for r in rows) else 0


def cmd_notify(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        conn.execute(
            query("notify_trigger", schema, keywords={"state": "ENABLE" if args.state == "on" else "DISABLE"})
        )
    print(f"NOTIFY on insert is {args.state} for schema {schema}")
    return 0


# -- dead letters ------------------------------------------------------------------------------


def _add_selector(parser: argparse.ArgumentParser, confirm_what: str | None = None) -> None:
    """The one way to choose dead letters, shared by dead list/redrive/skip and retry."""
    add_common(parser)
    parser.add_argument("ids", nargs="*", type=int, metavar="ID", help="these dead letters")
    parser.add_argument(
        "--ids", dest="more_ids", nargs="+", type=int, metavar="ID", help="these dead letters"
    )
    parser.add_argument("--key", help="of this key (UTF-8 text, or 0x... for bytes)")
    parser.add_argument("--topic", help="of this topic")
    parser.add_argument(
        "--error-like", help="whose error matches this SQL LIKE pattern, e.g. '%%timed out%%'"
    )
    parser.add_argument("--error", help="whose error contains this text, in any case (the console's filter)")
    parser.add_argument("--fingerprint", help="whose error's fingerprint is this (a console group)")
    parser.add_argument(
        "--since", help="that failed at or after this ISO time (UTC if no zone) or duration ago"
    )
    parser.add_argument("--until", help="that failed before this ISO time or duration ago")
    parser.add_argument(
        "--high-water", type=int, metavar="SEQ", help="made up to this mark (a console page's), none after it"
    )
    parser.add_argument("--all", action="store_true", help="every dead letter")
    if confirm_what is not None:
        add_confirm(parser, confirm_what)


def _add_unverified(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--include-unverified",
        action="store_true",
        help="also the dead letters given by ID that the relay could not verify as events of this "
        "outbox: unsigned_event (a WAL message no writer of it signed: any role may emit one) and "
        "corrupt_event (no event's encoding). Without it they stay; no filter but IDs takes them",
    )


def _selector(args: argparse.Namespace) -> dead.Selector:
    ids = tuple(args.ids or ()) + tuple(args.more_ids or ())
    unverified = getattr(args, "include_unverified", False)
    if unverified and (not ids or args.all or args.key or args.topic or args.error_like or args.error):
        raise ConfigError(
            "--include-unverified: only with dead letter IDs and no other filter: a message the relay "
            "could not verify is redriven one by one, knowingly"
        )
    key = key_arg(args.key)
    now = dt.datetime.now(dt.timezone.utc)
    try:
        return dead.Selector(
            ids=ids,
            key=key,
            topic=args.topic,
            error_like=args.error_like,
            everything=args.all or args.everything_unless_filtered,
            error=args.error,
            fingerprint=args.fingerprint,
            since=archive.parse_time(args.since, "--since", now) if args.since else None,
            until=archive.parse_time(args.until, "--until", now) if args.until else None,
            high_water=args.high_water,
            unverified=unverified,
        )
    except ConfigError as exc:
        if str(exc).startswith("--"):
            raise
        raise ConfigError(
            f"dead {args.dead_command}: give dead letter IDs, --key, --topic, --error-like, --error, "
            "--fingerprint, --since, --until or --all"
        ) from None


def _choosing(args: argparse.Namespace) -> dead.Selector:
    """What a command chooses among: listing and skipping the dead letters the relay could not
    verify is harmless, a redrive takes them only when asked (by id, --include-unverified)."""
    chosen = _selector(args)
    return chosen.also_unverified() if getattr(args, "dead_command", None) in ("list", "skip") else chosen


def cmd_dead_list(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        ids = dead.select(conn, schema, _choosing(args))[: args.limit]
        rows = dead.details(conn, schema, ids) if ids else []
    print(json.dumps(rows) if args.json else dead.render(rows))
    return 0


def _chosen(args: argparse.Namespace, verb: str, conn: Any, schema: str) -> list[int] | None:
    """The chosen ids after the dry run / confirmation; None when it was a dry run."""
    ids = dead.select(conn, schema, _choosing(args))
    if not ids:
        raise NothingMatched("no dead letter matches")
    shown = f"{ids[:20]}" + (" ..." if len(ids) > 20 else "")
    if args.dry_run:
        print(f"would {verb} {len(ids)} dead letters: {shown}")
        conn.rollback()
        return None
    confirm(args, f"{verb} {len(ids)} dead letters {shown}")
    return ids


def _dead_action(args: argparse.Namespace, action: str) -> int | None:
    """Choose, confirm, act and record it in the audit trail, in one transaction; how many."""
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        ids = _chosen(args, args.verb if action == "redrive" else action, conn, schema)
        if ids is None:
            return None
        n = dead.act(conn, schema, action, ids, _selector(args).audited())
        conn.commit()
    return n


def cmd_redrive(args: argparse.Namespace) -> int:
    n = _dead_action(args, "redrive")
    if n is None:
        return 0
    print(
        f"redrove {n} dead letters (attempts reset); they are delivered first, "
        "then the events parked behind them"
    )
    return 0


def cmd_skip(args: argparse.Namespace) -> int:
    n = _dead_action(args, "skip")
    if n is None:
        return 0
    print(f"skipped {n} dead letters; the events parked behind them are released")
    return 0


# -- the archive ---------------------------------------------------------------------------------


def cmd_replay(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    now = dt.datetime.now(dt.timezone.utc)
    since = archive.parse_time(args.since, "--since", now)
    until = archive.parse_time(args.until, "--until", now) if args.until else now
    archive.check_window(since, until, now, "--until")
    key = key_arg(args.key)
    with connect_outbox(args) as conn:
        n, upto = archive.replay_count(
            conn, schema, since=since, until=until, topic=args.topic, key=key, upto=args.upto
        )
        window = f"{since.isoformat(timespec='seconds')} .. {until.isoformat(timespec='seconds')}"
        if args.dry_run or not n:
            print(f"would replay {n} archived events delivered {window}")
            return 0
        confirm(args, f"replay {n} archived events delivered {window}")
        progress = Progress("replay", n, " ev")
        done = archive.replay_recorded(
            conn, schema, since=since, until=until, topic=args.topic, key=args.key, planned=n,
            upto=upto, progress=progress.update,
        )  # fmt: skip
        progress.close()
    print(f"queued {done} events again, with new event-ids and header outbox-replay-of")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    cutoff = dt.datetime.now(dt.timezone.utc) - archive.parse_duration(args.older_than, "--older-than")
    with connect_outbox(args) as conn:
        parts = archive.purge_plan(conn, schema, cutoff)
        what = f"{len(parts)} archive partitions before {cutoff.date().isoformat()}"
        if args.dry_run:
            print(
                f"would drop {what}: {', '.join(parts) or '-'} (and older rows of delivered_default, "
                "and claim-check payloads stored before the cutoff)"
            )
            return 0
        confirm(args, f"drop {what}")
        chosen = {"older_than": args.older_than, "cutoff": cutoff.isoformat(), "partitions": parts}
        entry = audit.begin(conn, schema, action="purge", selector=chosen, planned=len(parts))
        conn.commit()
        progress = Progress("purge", max(len(parts), 1), " partitions")
        deleted = archive.purge(conn, schema, cutoff, parts, progress=progress.update)
        progress.close()
        audit.done(conn, schema, entry, len(parts))
        conn.commit()
    store = _store(args, schema)
    try:
        payloads = store.purge(cutoff)
    finally:
        store.close()
    print(
        f"dropped {len(parts)} partitions; deleted {deleted} older rows from delivered_default "
        f"and {payloads} claim-check payloads ({store.name})"
    )
    return 0


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
            print(f"would delete {total} inbox records older than {args.older_than}")
            return 0
        progress = Progress("inbox prune", max(total, 1), " records")
        deleted = inbox.prune(conn, age, schema=schema, progress=progress.update)
        progress.close()
    print(f"deleted {deleted} inbox records older than {args.older_than}")
    return 0


# -- the audit trail -----------------------------------------------------------------------------


def cmd_audit(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ConfigError(f"--limit: must be >= 1, got {args.limit}")
    with connect_outbox(args) as conn:
        rows = audit.recent(conn, schema_of(args), args.limit)
    print(json.dumps(rows) if args.json else audit.render(rows))
    return 0
