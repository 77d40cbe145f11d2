"""Which outboxes a relay serves: ``NAME=DSN[#SCHEMA]`` specs, a file of them, and schemas
found by a glob.

An outbox is one migrated schema in one database, and its name is what metrics, spans,
``/readyz`` and ``outbox status --all`` call it. A name is short and plain (letters, digits,
``_ . : -``) because it becomes a Prometheus label value and a log field; it never carries
a password. The DSN keeps the password, and leaves this module only through
:func:`outbox.store.dsn.redact`.

``#`` separates the schema from the DSN (``postgresql://app@db/orders#tenant_42``). A URL
keeps ``#`` for its fragment, which libpq does not use, and a ``#`` inside a password must be
percent-encoded in a URL anyway; in a ``key=value`` DSN, quote such a password
(``password='a#b'``): only a ``#`` outside quotes ends the DSN.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from outbox.errors import ConfigError, NotMigrated
from outbox.store.dsn import SECRET_PARAMS, error_line, redact
from outbox.store.migrate import require_known
from outbox.store.queries import query
from outbox.store.schema import DEFAULT_SCHEMA, FLEET_SCHEMA, validate_schema
from outbox.store.trust import refusal, untrusted

DEFAULT_NAME = "default"  # the outbox of --dsn/--schema
DISCOVER_EVERY = 30.0  # seconds between looks for schemas matching --schemas
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,99}")


@dataclass(frozen=True)
class Outbox:
    """One outbox: a migrated schema in one database, under a name of its own."""

    name: str
    dsn: str
    schema: str = DEFAULT_SCHEMA

    @property
    def display(self) -> str:
        """The name, the database (password masked) and the schema: for logs and errors."""
        return f"{self.name} ({redact(self.dsn)}#{self.schema})"

    @property
    def database(self) -> tuple[tuple[str, str], ...]:
        """What identifies the database (every setting of the DSN but the password): outboxes
        with the same one share its connections and its LISTEN."""
        return database_of(self.dsn)


def database_of(dsn: str) -> tuple[tuple[str, str], ...]:
    """The DSN's settings, password left out, as a hashable key."""
    params = conninfo_to_dict(dsn)
    for name in SECRET_PARAMS:
        params.pop(name, None)
    return tuple(sorted((k, str(v)) for k, v in params.items()))


def validate_outbox_name(name: str, field: str) -> str:
    if not NAME.fullmatch(name):
        raise ConfigError(
            f"{field}: outbox name {name!r}: 1-100 letters, digits or _ . : - (it becomes a metric "
            "label), starting with a letter or digit"
        )
    return name


def _split_schema(text: str) -> tuple[str, str | None]:
    """``DSN[#SCHEMA]`` -> (DSN, SCHEMA or None): the last ``#`` outside single quotes."""
    quoted = False
    cut = -1
    for i, ch in enumerate(text):
        if ch == "'" and (i == 0 or text[i - 1] != "\\"):
            quoted = not quoted
        elif ch == "#" and not quoted:
            cut = i
    if cut < 0:
        return text, None
    return text[:cut], text[cut + 1 :]


def parse_outbox(spec: str, field: str = "--outbox") -> Outbox:
    """``NAME=DSN[#SCHEMA]`` -> an Outbox; errors name ``field`` and never echo the DSN."""
    name, sep, rest = spec.partition("=")
    name = name.strip()
    if not sep or not name or not rest.strip():
        shown = validate_outbox_name(name, field) if name and NAME.fullmatch(name) else "NAME"
        raise ConfigError(f"{field}: expected NAME=DSN[#SCHEMA], got {shown}=… without a DSN")
    validate_outbox_name(name, field)
    dsn, schema = _split_schema(rest.strip())
    try:
        conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise ConfigError(f"{field}: outbox {name!r}: the DSN is not a valid connection string") from None
    schema = DEFAULT_SCHEMA if schema is None or not schema.strip() else schema.strip()
    return Outbox(name, dsn, validate_schema(schema, f"{field}: outbox {name!r}: schema"))


def read_outboxes_file(path: Path) -> list[Outbox]:
    """The outboxes of a file: ``NAME=DSN[#SCHEMA]`` a line; blank lines and lines starting
    with ``#`` are skipped. Errors name the file and the line."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"--outboxes-file: cannot read {path}: {exc.strerror}") from None
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if line and not line.startswith("#"):
            found.append(parse_outbox(line, f"--outboxes-file {path}:{number}"))
    return found


def unique(outboxes: Iterable[Outbox]) -> list[Outbox]:
    """The outboxes in order, refusing two of the same name or the same schema in one database."""
    by_name: dict[str, Outbox] = {}
    by_place: dict[tuple[Any, str], str] = {}
    for o in outboxes:
        if o.name in by_name:
            raise ConfigError(f"--outbox: the name {o.name!r} is given twice")
        place = (o.database, o.schema)
        if place in by_place:
            raise ConfigError(
                f"--outbox: {by_place[place]!r} and {o.name!r} are the same schema {o.schema!r} "
                "of the same database"
            )
        by_name[o.name] = o
        by_place[place] = o.name
    return list(by_name.values())


def matching_schemas(conn: psycopg.Connection[Any], pattern: str) -> list[str]:
    """Schemas whose name matches the glob ``pattern`` (fnmatch) and that hold outbox tables
    (a ``schema_migrations`` table), by name."""
    names = [r[0] for r in conn.execute(query("outbox_schemas", "public")).fetchall()]
    return sorted(n for n in names if fnmatch.fnmatchcase(n, pattern))


def discover(
    conn: psycopg.Connection[Any],
    pattern: str,
    dsn: str,
    *,
    prefix: str = "",
    known: Collection[str] = (),
    owners: Collection[str] = (),
) -> tuple[list[Outbox], dict[str, str]]:
    """The migrated outboxes among the schemas matching ``pattern`` in ``conn``'s database,
    named ``prefix + schema``; and the others, schema -> why they are not served (not migrated
    to this version, not a usable name, or not owned by a trusted role: :func:`untrusted`).

    ``known``: schemas an earlier look found migrated (a relay's discovery, every few seconds).
    They must still be listed, but their migrations are not read again: migrations are never
    undone, and reading 200 tenants' every 2 s took a loaded relay seconds per look. Their
    owners are read again on every look (one statement for all): ownership can change."""
    served, skipped = [], {}
    matching = matching_schemas(conn, pattern)
    refused = untrusted(conn, [*matching, FLEET_SCHEMA], owners)
    fleet = refused.pop(FLEET_SCHEMA, None)
    for schema in matching:
        if fleet is not None:  # the relays' membership, in every outbox's claims: none is served
            skipped[schema] = refusal(FLEET_SCHEMA, fleet)
            continue
        if schema in refused:
            skipped[schema] = refusal(schema, refused[schema])
            continue
        try:
            validate_schema(schema, "schema")
            if schema not in known:
                require_known(conn, schema, "schema")
            name = validate_outbox_name(prefix + schema, "--schemas")
        except (NotMigrated, ConfigError) as exc:
            skipped[schema] = str(exc)
            conn.rollback()
            continue
        except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
            # Dropped between the listing and this look (a tenant removed while a relay runs):
            # it is not there, and not an error. Raised, it stopped the relay serving the rest.
            conn.rollback()
            continue
        except psycopg.OperationalError:
            raise  # the connection or the server: the whole look fails (the caller keeps the list)
        except psycopg.Error as exc:  # this schema's own (e.g. no privilege on it): the rest go on
            skipped[schema] = f"schema: {schema!r} cannot be read: {error_line(exc, dsn)}"
            conn.rollback()
            continue
        served.append(Outbox(name, dsn, schema))
    return served, skipped
