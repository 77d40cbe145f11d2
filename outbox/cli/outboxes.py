"""The outboxes a command works on: ``--outbox``, ``--schemas`` with ``--dsn``, ``--outboxes-file``,
or the one named ``default`` of ``--dsn``/``--schema`` (relay, migrate and status)."""

from __future__ import annotations

import argparse
import fnmatch
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox.cli import options
from outbox.cli.common import connect, dsn_of, schema_of, schema_owners
from outbox.errors import ConfigError
from outbox.settings import setting
from outbox.store.dsn import error_line, redact
from outbox.store.outboxes import (
    DEFAULT_NAME,
    DISCOVER_EVERY,
    Outbox,
    discover,
    parse_outbox,
    read_outboxes_file,
    unique,
    validate_outbox_name,
)
from outbox.store.queries import query
from outbox.store.schema import FLEET_SCHEMA
from outbox.store.trust import refusal, untrusted


@dataclass
class OutboxOptions:
    outbox: list[str] = setting(
        default_factory=list,
        help="NAME=DSN[#SCHEMA]: an outbox, repeatable (in the variable: one a line); NAME labels its "
        "metrics, spans and status lines",
        env="OUTBOX_OUTBOXES",
        metavar="NAME=DSN[#SCHEMA]",
    )
    schemas: str | None = setting(
        None,
        "every schema matching GLOB (fnmatch) that holds an outbox, in each --dsn; named after the "
        "schema (database.schema with several --dsn)",
        metavar="GLOB",
    )
    outboxes_file: str | None = setting(
        None,
        "a file of NAME=DSN[#SCHEMA] lines (# comments); the relay re-reads it on SIGHUP",
        metavar="PATH",
    )
    schema_owner: list[str] = setting(
        default_factory=list,
        help="an outbox's schema (named or found by --schemas) and the database's outbox_fleet are "
        "used only when they and everything in them are owned by this role, repeatable (in the "
        "variable: separated by whitespace); default: the role the command connects as and the "
        "database's owner (superusers always). A schema a tenant owns, or may create in, could run "
        "code as the relay: it is refused, saying why",
        metavar="ROLE",
    )


@dataclass
class DiscoveryOptions:
    discover_every: float = setting(
        DISCOVER_EVERY, "seconds between looks for new and dropped schemas matching --schemas"
    )


def add_outboxes(parser: argparse.ArgumentParser) -> None:
    options.add(parser, OutboxOptions)


@dataclass
class Chosen:
    """What the options chose: the outboxes, and what could not be looked at or served."""

    outboxes: list[Outbox] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # what -> why (not migrated, unreachable)
    several: bool = False  # more than the single default outbox could be meant (--all output)
    unreachable: list[str] = field(default_factory=list)  # the --dsn of --schemas that could not be read


def given_specs(args: argparse.Namespace) -> list[str]:
    """Every --outbox spec, the variable's lines split (a key=value DSN holds spaces: only a new
    line separates two specs)."""
    return [line.strip() for item in args.outbox or [] for line in item.splitlines() if line.strip()]


def is_fleet(args: argparse.Namespace) -> bool:
    """Did the command line name outboxes (not just the default --dsn/--schema)?"""
    return bool(given_specs(args) or args.schemas or args.outboxes_file)


def _prefix(dsn: str, several: bool) -> str:
    if not several:
        return ""
    dbname = conninfo_to_dict(dsn).get("dbname") or "db"
    return f"{dbname}."


def choose(
    args: argparse.Namespace,
    *,
    every_schema: bool = False,
    known: Collection[tuple[str, str]] = (),
) -> Chosen:
    """The outboxes of the command line. ``every_schema``: --schemas matches every schema that
    exists (migrate: a new tenant's schema gets its tables), not only those holding an outbox.
    ``known``: (DSN, schema) pairs an earlier look found migrated, not looked into again.
    A database that cannot be reached for --schemas is reported in ``skipped``, not raised."""
    dsns: list[str] = args.dsn or []
    if not is_fleet(args):
        chosen = Chosen()
        default = [Outbox(DEFAULT_NAME, dsn_of(args), schema_of(args))]
        chosen.outboxes = default if every_schema else _trusted(args, default, chosen)
        return chosen
    if dsns and not args.schemas:
        raise ConfigError(
            "--dsn: with --outbox or --outboxes-file, --dsn is used only with --schemas; "
            f"name that database's outbox with --outbox {DEFAULT_NAME}=DSN#SCHEMA"
        )
    chosen = Chosen(several=True)
    found = [parse_outbox(spec) for spec in given_specs(args)]
    if args.outboxes_file:
        found += read_outboxes_file(Path(args.outboxes_file))
    if found and not every_schema:
        found = _trusted(args, found, chosen)
    if args.schemas:
        for dsn in dsns or [""]:
            prefix = _prefix(dsn, len(dsns) > 1)
            try:
                with connect(args, dsn) as conn:
                    # Each look its own statement: a transaction over 200 tenants' looks held a
                    # snapshot (vacuum waits) and every migrations table's lock (migrate waits).
                    conn.autocommit = True
                    if every_schema:
                        found += _every_schema(conn, args.schemas, dsn, prefix)
                    else:
                        mine = {schema for d, schema in known if d == dsn}
                        served, skipped = discover(
                            conn, args.schemas, dsn, prefix=prefix, known=mine, owners=schema_owners(args)
                        )
                        found += served
                        chosen.skipped.update({f"{prefix}{k}": v for k, v in skipped.items()})
            except ConfigError as exc:  # unreachable: the others still go on
                chosen.skipped[redact(dsn) or "(PG* variables)"] = str(exc)
                chosen.unreachable.append(dsn)
            except psycopg.Error as exc:  # reached, but the look failed: as unreachable, this time
                why = f"cannot look for outboxes: {error_line(exc, dsn)}"
                chosen.skipped[redact(dsn) or "(PG* variables)"] = why
                chosen.unreachable.append(dsn)
    chosen.outboxes = unique(found)
    return chosen


def _trusted(args: argparse.Namespace, named: list[Outbox], chosen: Chosen) -> list[Outbox]:
    """Of the outboxes named (--outbox, --outboxes-file), those whose schema and whose database's
    outbox_fleet are trusted (outbox.trust), as discovered ones must be; the others go to
    ``chosen.skipped`` with the reason. A database that cannot be reached keeps its outboxes:
    serving them reports that, as before."""
    by_dsn: dict[str, list[Outbox]] = {}
    for o in named:
        by_dsn.setdefault(o.dsn, []).append(o)
    kept: list[Outbox] = []
    for dsn, outboxes in by_dsn.items():
        try:
            with connect(args, dsn) as conn:
                refused = untrusted(conn, [*(o.schema for o in outboxes), FLEET_SCHEMA], schema_owners(args))
        except (ConfigError, psycopg.OperationalError):
            kept += outboxes
            continue
        fleet = refused.pop(FLEET_SCHEMA, None)
        for o in outboxes:
            if fleet is not None:
                chosen.skipped[o.name] = refusal(FLEET_SCHEMA, fleet)
            elif o.schema in refused:
                chosen.skipped[o.name] = refusal(o.schema, refused[o.schema])
            else:
                kept.append(o)
    return kept


def _every_schema(conn: psycopg.Connection[Any], pattern: str, dsn: str, prefix: str) -> list[Outbox]:
    names = [r[0] for r in conn.execute(query("user_schemas", "public")).fetchall()]
    return [
        Outbox(validate_outbox_name(prefix + n, "--schemas"), dsn, n)
        for n in sorted(names)
        if fnmatch.fnmatchcase(n, pattern)
    ]
