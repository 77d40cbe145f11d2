"""Create (or bring up to date) the outbox schema with the shipped SQL migrations.

A later outbox release that ships new SQL migrations adds a Django migration that
runs the same operation again; it applies only what the schema lacks.
"""

from __future__ import annotations

from typing import Any, ClassVar

from django.conf import settings
from django.db import migrations

from outbox.store.migrate import migrate_cursor
from outbox.store.schema import DEFAULT_SCHEMA


def apply(apps: Any, schema_editor: Any) -> None:
    connection = schema_editor.connection
    if connection.alias != getattr(settings, "OUTBOX_DATABASE", "default"):
        return
    if connection.vendor != "postgresql":
        raise RuntimeError(f"outbox needs PostgreSQL; database {connection.alias!r} is {connection.vendor}")
    with connection.cursor() as cursor:
        migrate_cursor(cursor, getattr(settings, "OUTBOX_SCHEMA", DEFAULT_SCHEMA))


class Migration(migrations.Migration):
    initial = True
    dependencies: ClassVar[list[tuple[str, str]]] = []
    # Unapplying leaves the schema and its events: drop it yourself if you mean to.
    operations: ClassVar[list[Any]] = [migrations.RunPython(apply, migrations.RunPython.noop, elidable=False)]
