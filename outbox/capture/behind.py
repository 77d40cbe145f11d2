"""The keys of a WAL batch with older events waiting in the events table (retries, delayed, held
behind a failure, or a parked dead letter): their events read from the WAL are held, and go into
the table behind those when the batch finishes, so that a key's events stay in order."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import psycopg

from outbox.store.queries import query


def keys_waiting(
    conn: psycopg.Connection[Any], schema: str, keys: Collection[bytes]
) -> dict[bytes | None, float]:
    """Each of ``keys`` with events waiting in ``schema``'s table, and when its oldest waiting one
    was created. One cheap look first: a table with nothing waiting answers no key."""
    if not keys:
        return {}
    quiet = conn.execute(query("wal_table_quiet", schema)).fetchone()
    if quiet is not None and quiet[0]:
        return {}
    rows = conn.execute(query("wal_keys_waiting", schema), {"keys": list(keys)}).fetchall()
    return {row[0]: row[1] for row in rows}
