"""Apply outbox's migrations inside an Alembic revision.

In a revision of your own (``alembic revision -m "outbox"``)::

    from outbox.contrib.alembic import upgrade as outbox_upgrade

    def upgrade() -> None:
        outbox_upgrade(op, schema="outbox")

It runs the shipped SQL (the same as ``outbox migrate --print``), in the revision's
transaction, through the connection Alembic migrates with (psycopg 3 or psycopg2),
and records what it applied in ``<schema>.schema_migrations`` like ``outbox migrate``,
so either tool may run next. After upgrading outbox, add a revision that calls it
again: it applies only the migrations the schema lacks. Offline mode (``alembic
upgrade --sql``) has no connection: use ``outbox migrate --print`` for that script.
"""

from __future__ import annotations

from typing import Any

from outbox.store.migrate import Migration, migrate_cursor
from outbox.store.schema import DEFAULT_SCHEMA


def upgrade(op: Any, schema: str = DEFAULT_SCHEMA) -> list[Migration]:
    """Apply the outbox migrations ``schema`` lacks, in the current Alembic revision."""
    dbapi = op.get_bind().connection.dbapi_connection
    cursor = dbapi.cursor()
    try:
        return migrate_cursor(cursor, schema)
    finally:
        cursor.close()
