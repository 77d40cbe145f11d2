"""Whose schemas the project may run code in.

The relay, ``outbox status``, the console and ``migrate`` run statements in an outbox's schema and
in the database's ``outbox_fleet`` (the relays' membership, migration 0018) with their own rights,
and each of those statements may run code that lives there: a trigger's function, a view, an
overload, a function the relay calls (``ensure_delivered_partitions``). A schema is trusted when it
and everything in it is owned by a trusted role and no other role may create in it or add triggers
to its tables. Trusted: ``--schema-owner`` roles when given, else the role that connects and the
database's owner; superusers always (they can do anything anyway). A refusal is one line saying
why (docs/security.md, "Tenants" and "PostgreSQL's own seams").
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import psycopg

from outbox.errors import ConfigError
from outbox.store.queries import query
from outbox.store.schema import FLEET_SCHEMA

TRUSTED = "not by a trusted role (the connecting role, the database's owner, or --schema-owner)"


def untrusted(
    conn: psycopg.Connection[Any], schemas: Collection[str], owners: Collection[str] = ()
) -> dict[str, str]:
    """Of ``schemas``, those a role other than the trusted owners could have put code into:
    schema -> the first reason. Schemas that do not exist are not in the answer."""
    if not schemas:
        return {}
    rows = conn.execute(
        query("untrusted_schemas", "public"), {"schemas": list(schemas), "owners": list(owners)}
    ).fetchall()
    return {str(schema): str(why) for schema, why in rows}


def refusal(schema: str, why: str, runs_as: str = "the relay") -> str:
    """The one line that says why ``schema`` is not used."""
    if schema == FLEET_SCHEMA:
        return (
            f"schema: the relays' membership schema {FLEET_SCHEMA!r} is not trusted: {why}, {TRUSTED}; "
            f"it could run code as {runs_as}"
        )
    return f"schema: {schema!r} is not trusted: {why}, {TRUSTED}; it could run code as {runs_as}"


def require_trusted(
    conn: psycopg.Connection[Any],
    schemas: Collection[str],
    owners: Collection[str] = (),
    *,
    runs_as: str = "the relay",
) -> None:
    """Raise ConfigError (one line) for the first of ``schemas`` that is not trusted, the
    membership schema first: it is in every outbox's claims."""
    refused = untrusted(conn, schemas, owners)
    for schema in sorted(refused, key=lambda s: s != FLEET_SCHEMA):
        raise ConfigError(refusal(schema, refused[schema], runs_as))
