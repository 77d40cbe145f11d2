"""Migrations: plain SQL files in ``migrations/``, applied in order, recorded.

Each file ``NNNN_name.sql`` runs in its own transaction together with the row
that records it in ``<schema>.schema_migrations``, under an advisory lock so
that relays starting side by side do not race. ``render_all`` produces the same
SQL as one script for teams that run migrations with their own tool.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from collections.abc import Collection
from dataclasses import dataclass
from functools import partial
from typing import Any

import psycopg
from psycopg import sql

from outbox._version import __version__
from outbox.errors import ConfigError, NotMigrated, SchemaTooNew
from outbox.store import pinning
from outbox.store.lock_wait import LockWait, limited, retrying
from outbox.store.queries import query
from outbox.store.schema import DEFAULT_SCHEMA, FLEET_SCHEMA, channel_name, validate_name, validate_schema
from outbox.store.trust import refusal, require_trusted

_FILE = re.compile(r"^(\d{4})_(\w+)\.sql$")
# Outboxes to migrate on one connection before taking a fresh one (``outbox migrate --schemas``,
# the bench's tenants). A session's processing of every DDL statement's invalidations grows with
# what it has cached, and so does each migration's time on it (decision 0013).
PER_CONNECTION = 50
# Who a membership schema's code would run as, in the refusal of one that is not trusted.
MIGRATOR = "this migration (often a superuser) and every relay of the database"
# Released migrations amended since, by version: the checksums of their earlier texts, which an
# install made before the amendment recorded. An amendment only makes a new install safe from its
# first statement on; the migration that follows it (named here) does the same to existing ones.
AMENDED: dict[int, frozenset[str]] = {
    # 0001's two functions pin search_path in their definitions (0019 pins them where 0001 ran
    # before): the first call of ensure_delivered_partitions is in 0001 itself.
    1: frozenset({"58d56b8e2813a339bec9788ecb28defb285a8fcea3ecb275c3c996f2f04ed62e"}),
}


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    text: str

    @property
    def inbox(self) -> bool:
        """Part of the consumer inbox (``migrate --inbox-only`` applies only these)."""
        return self.name.startswith("inbox")

    @property
    def shares_fleet(self) -> bool:
        """Creates objects in the database's shared ``outbox_fleet`` (when missing)."""
        return FLEET_SCHEMA in self.text

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def render(self, schema: str) -> sql.Composed:
        # Comment lines go first: a name is a quoted identifier in SQL, but in a
        # comment a line break inside it would end the comment and run the rest.
        return sql.SQL(_strip_comments(self.text)).format(
            schema=sql.Identifier(schema),
            schema_name=sql.Literal(schema),
            channel=sql.Literal(channel_name(schema)),
        )


def migrations(*, inbox_only: bool = False) -> list[Migration]:
    """Every migration shipped with the package, in order (``inbox_only``: the inbox's)."""
    found = []
    for entry in importlib.resources.files("outbox.migrations").iterdir():
        m = _FILE.match(entry.name)
        if m:
            found.append(Migration(int(m.group(1)), m.group(2), entry.read_text("utf-8")))
    found.sort(key=lambda m: m.version)
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError(f"duplicate migration versions: {versions}")
    return [m for m in found if m.inbox] if inbox_only else found


def _preamble(schema: str) -> sql.Composed:
    return query("migrate_preamble", schema)


def _record(schema: str, m: Migration) -> sql.Composed:
    return query(
        "migrate_record", schema, literals={"version": m.version, "name": m.name, "checksum": m.checksum}
    )


def render_all(schema: str = DEFAULT_SCHEMA, roles: Roles | None = None, *, inbox_only: bool = False) -> str:
    """All migrations as one SQL script, exactly what ``migrate`` applies (with ``roles``: and
    grants; with ``inbox_only``: only the inbox's)."""
    validate_schema(schema)
    parts = [
        "-- outbox migrations for schema " + sql.Identifier(schema).as_string(),
        "BEGIN;",
        "-- names resolve in pg_catalog only while these statements run (outbox.pinning)",
        query("pin_search_path_local", schema).as_string() + ";",
        _preamble(schema).as_string() + ";",
    ]
    for m in migrations(inbox_only=inbox_only):
        parts.append(f"\n-- migration {m.version:04d}_{m.name}")
        parts.append(m.render(schema).as_string().rstrip())
        parts.append(_record(schema, m).as_string() + ";")
    if roles is not None:
        parts.append(
            "\n-- roles: writer "
            + sql.Identifier(roles.writer).as_string()
            + ", relay "
            + sql.Identifier(roles.relay).as_string()
            + ", console "
            + sql.Identifier(roles.console).as_string()
        )
        parts.extend(statement.as_string() + ";" for statement in render_roles(schema, roles))
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


def _fleet_trusted(cursor: Any, owners: Collection[str]) -> None:
    """:func:`outbox.store.trust.require_trusted` of ``outbox_fleet`` through another tool's cursor."""
    statement = query("untrusted_schemas", "public").as_string()
    cursor.execute(statement, {"schemas": [FLEET_SCHEMA], "owners": list(owners)})
    for _, why in cursor.fetchall():
        raise ConfigError(refusal(FLEET_SCHEMA, str(why), MIGRATOR))


def _pin(conn: psycopg.Connection[Any]) -> None:
    """Names resolve in pg_catalog only for the rest of this transaction (:mod:`outbox.store.pinning`),
    whatever the caller's session: a migration runs as its owner, often a superuser, and what it
    binds (a generated column's function, a default) stays bound."""
    conn.execute(query("pin_search_path_local", "public"), prepare=False)


def _lock_key(schema: str) -> int:
    digest = hashlib.sha256(("outbox-migrate:" + schema).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)


def applied_versions(conn: psycopg.Connection[Any], schema: str) -> dict[int, str]:
    """Versions recorded in ``schema`` (empty when it was never migrated)."""
    row = conn.execute(query("migrations_table", schema), (schema,)).fetchone()
    if not row or row[0] is None:
        return {}
    rows = conn.execute(query("migrations_applied", schema)).fetchall()
    return {int(v): str(c) for v, c in rows}


def require_migrated(
    conn: psycopg.Connection[Any],
    schema: str,
    field: str = "--schema",
    *,
    applied: dict[int, str] | None = None,
) -> None:
    """Refuse a schema that lacks any migration this version ships, naming the missing ones."""
    if applied is None:
        applied = applied_versions(conn, schema)
    if not applied:
        raise NotMigrated(f"{field}: {schema!r} is not migrated; run `outbox migrate`")
    missing = [f"{m.version:04d}_{m.name}" for m in migrations() if m.version not in applied]
    if missing:
        raise NotMigrated(
            f"{field}: {schema!r} lacks migrations {', '.join(missing)}; run `outbox migrate` "
            "before starting this version"
        )


def require_known(conn: psycopg.Connection[Any], schema: str, field: str = "--schema") -> None:
    """What a relay asks of an outbox it is to serve: every migration this version ships
    (:func:`require_migrated`), and none it does not know. A newer version's migration may change
    what this version's statements would do (a column its claims must read): SchemaTooNew,
    naming both versions, and the relay serves its other outboxes."""
    applied = applied_versions(conn, schema)
    require_migrated(conn, schema, field, applied=applied)
    known = max(m.version for m in migrations())
    beyond = sorted(v for v in applied if v > known)
    if beyond:
        raise SchemaTooNew(
            f"{field}: {schema!r} is migrated to {beyond[-1]:04d}, past what outbox {__version__} knows "
            f"({known:04d}): serve it from a relay of the version that migrated it"
        )


def _applied_already(m: Migration, done: dict[int, str], schema: str) -> bool:
    """Whether ``m`` is recorded in ``schema``; ConfigError if it was, with other content."""
    if m.version not in done:
        return False
    if done[m.version] != m.checksum and done[m.version] not in AMENDED.get(m.version, ()):
        raise ConfigError(
            f"migration {m.version:04d}_{m.name} was applied to schema {schema!r} "
            "with different content; migrations must never be edited once released"
        )
    return True


def migrate(
    conn: psycopg.Connection[Any],
    schema: str = DEFAULT_SCHEMA,
    *,
    inbox_only: bool = False,
    owners: Collection[str] = (),
    locks: LockWait | None = None,
) -> list[Migration]:
    """Apply the migrations ``schema`` lacks; return them. Safe to run again and concurrently.
    ``inbox_only``: only the consumer inbox's (in a consumer's own database); a later full
    migrate applies the rest and skips what is there. ``owners``: the roles trusted to own the
    database's ``outbox_fleet`` (``--schema-owner``; else the migrating role and the database's
    owner), which a schema another role made first, or may create in, must not become.
    ``locks``: how each migration waits for its tables' locks (:mod:`outbox.store.lock_wait`:
    2 s a try, so that writers never queue long behind it, retried for up to 10 minutes)."""
    validate_schema(schema)
    policy = locks or LockWait()

    def preamble() -> None:
        with conn.transaction():
            _pin(conn)
            conn.execute(query("migrate_lock", schema), (_lock_key(schema),))
            require_trusted(conn, [FLEET_SCHEMA], owners, runs_as=MIGRATOR)
            with limited(conn, policy):
                conn.execute(_preamble(schema))

    def apply(m: Migration) -> bool:
        with conn.transaction():
            _pin(conn)
            conn.execute(query("migrate_lock", schema), (_lock_key(schema),))
            if _applied_already(m, applied_versions(conn, schema), schema):
                return False
            with limited(conn, policy):
                conn.execute(m.render(schema))
            if m.shares_fleet:  # a schema of that name made meanwhile was adopted: refused, rolled back
                require_trusted(conn, [FLEET_SCHEMA], owners, runs_as=MIGRATOR)
            conn.execute(_record(schema, m))
            return True

    retrying(conn, schema, f"schema {schema}: its migrations table", policy, preamble)
    applied: list[Migration] = []
    for m in migrations(inbox_only=inbox_only):
        what = f"schema {schema}: migration {m.version:04d}_{m.name}"
        if retrying(conn, schema, what, policy, partial(apply, m)):
            applied.append(m)
    return applied


def migrate_cursor(
    cursor: Any, schema: str = DEFAULT_SCHEMA, *, owners: Collection[str] = ()
) -> list[Migration]:
    """:func:`migrate` inside another tool's transaction (Django's ``migrate``, an Alembic
    revision): the same statements, run through a DBAPI cursor of psycopg 3 or psycopg2
    (Django's cursor wrapper too), in the caller's transaction. The caller commits."""
    validate_schema(schema)
    # The tool's transaction keeps its own search_path after ours: pinned for our statements only.
    saved = pinning.pin_transaction(cursor)
    cursor.execute(query("migrate_lock", schema).as_string(), (_lock_key(schema),))
    _fleet_trusted(cursor, owners)
    cursor.execute(_preamble(schema).as_string())
    cursor.execute(query("migrations_applied", schema).as_string())
    done = {int(v): str(c) for v, c in cursor.fetchall()}
    applied: list[Migration] = []
    for m in migrations():
        if _applied_already(m, done, schema):
            continue
        cursor.execute(m.render(schema).as_string())
        if m.shares_fleet:
            _fleet_trusted(cursor, owners)
        cursor.execute(_record(schema, m).as_string())
        applied.append(m)
    pinning.restore(cursor, saved)
    return applied


# Least-privilege roles (``migrate --roles``): see migrations/roles.sql.
DEFAULT_WRITER_ROLE = "outbox_writer"
DEFAULT_RELAY_ROLE = "outbox_relay"
DEFAULT_CONSOLE_ROLE = "outbox_console"
MAX_ROLE_BYTES = 63


def validate_role(role: object, field: str) -> str:
    """Return ``role`` if PostgreSQL accepts it as a role name as given, else raise naming ``field``."""
    role = validate_name(role, field, MAX_ROLE_BYTES)
    if role in ("public", "none", "current_user", "session_user"):
        raise ConfigError(f"{field}: {role!r} is reserved by PostgreSQL")
    return role


@dataclass(frozen=True)
class Roles:
    """The writer, relay and console roles, and whether ``migrate`` creates them when missing."""

    writer: str = DEFAULT_WRITER_ROLE
    relay: str = DEFAULT_RELAY_ROLE
    create: bool = True
    console: str = DEFAULT_CONSOLE_ROLE

    def __post_init__(self) -> None:
        validate_role(self.writer, "writer role")
        validate_role(self.relay, "relay role")
        validate_role(self.console, "console role")
        if self.writer == self.relay:
            raise ConfigError(
                "relay role: must differ from the writer role (the writer must not read events)"
            )
        if self.console in (self.writer, self.relay):
            raise ConfigError("console role: must differ from the writer and relay roles")

    @property
    def all(self) -> tuple[tuple[str, str], ...]:
        """(field, role) of each role."""
        return (("writer role", self.writer), ("relay role", self.relay), ("console role", self.console))


def _roles_text() -> str:
    return importlib.resources.files("outbox.migrations").joinpath("roles.sql").read_text("utf-8")


def _create_role(schema: str, role: str) -> sql.Composed:
    # The role name reaches the DO body as a quoted identifier, and the body reaches
    # the DO statement as a string literal, so no name can end the body early.
    body = query("create_role_body", schema, identifiers={"role": role}).as_string()
    return query("do_block", schema, literals={"body": body})


def render_roles(schema: str, roles: Roles) -> list[sql.Composed]:
    """The statements that create (optionally) and grant the two roles, in order."""
    validate_schema(schema)
    out = [_create_role(schema, r) for _, r in roles.all] if roles.create else []
    # WAL capture's keys: nobody but their owner and the relay role reads them, whatever was
    # granted since (default privileges, a hand-made GRANT); then roles.sql grants the relay's.
    revoke = query("revoke_key_readers_body", schema, literals={"relay_name": roles.relay}).as_string()
    out.append(query("do_block", schema, literals={"body": revoke}))
    for statement in _strip_comments(_roles_text()).split(";"):
        if statement.strip():
            out.append(
                sql.SQL(statement.strip()).format(
                    schema=sql.Identifier(schema),
                    writer=sql.Identifier(roles.writer),
                    relay=sql.Identifier(roles.relay),
                    console=sql.Identifier(roles.console),
                    sequence=sql.Identifier(schema, "events_id_seq"),
                    audit_sequence=sql.Identifier(schema, "audit_id_seq"),
                )
            )
    # PostgreSQL 17+: MAINTAIN lets the relay VACUUM its hot table without owning it.
    maintain = query("grant_maintain", schema, identifiers={"relay": roles.relay}).as_string()
    body = query("if_server_17_body", schema, literals={"statement": maintain}).as_string()
    out.append(query("do_block", schema, literals={"body": body}))
    return out


def _strip_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("--"))


def grant_roles(conn: psycopg.Connection[Any], schema: str, roles: Roles) -> None:
    """Create (unless ``roles.create`` is false) and grant the writer, relay and console roles."""
    validate_schema(schema)
    if not roles.create:
        for field, role in roles.all:
            if conn.execute(query("role_exists", schema), (role,)).fetchone() is None:
                raise ConfigError(f"{field}: {role!r} does not exist (create it, or drop --no-create-roles)")
    with conn.transaction():
        _pin(conn)
        conn.execute(query("migrate_lock", schema), (_lock_key(schema),))
        for statement in render_roles(schema, roles):
            conn.execute(statement)
