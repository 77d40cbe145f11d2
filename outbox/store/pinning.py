"""Every session the project opens resolves names in pg_catalog only.

PostgreSQL looks a function or operator up along ``search_path``, by default ``"$user", public``,
after pg_catalog. An overload there that matches a call's argument types more exactly than
pg_catalog's does (``to_char(date, text)`` beside ``to_char(timestamp, text)``;
``unnest(uuid[])`` beside ``unnest(anyarray)``) is the one called, with the caller's rights. Any
role that may CREATE in the database can make a schema named after another role, and on
PostgreSQL 14 and older every login role may create in ``public``. So every session the relay,
the listener, the WAL reader, the console, the CLI and ``migrate`` open runs
``search_path = pg_catalog, pg_temp`` before any other statement (:func:`connect`, :func:`pin`),
and every function a migration creates pins it in its definition.

Set with ``set_config`` once connected, not as the startup packet's ``options``, which PgBouncer
refuses. A session-level setting would leak through a transaction pooler to another client's
transactions: the relay, the console and the CLI refuse one (:mod:`outbox.store.pooling`). The SQL the
writers and the inbox run on the application's own session (its path is the application's)
names pg_catalog's functions in full instead.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox.store.queries import query

SEARCH_PATH = "pg_catalog, pg_temp"
# A replication connection (WAL capture's reader, psycopg2) runs no SQL of ours, and no pooler
# carries one: it takes the setting in its startup packet.
REPLICATION_OPTIONS = "-c search_path=pg_catalog,pg_temp"


def pin(conn: psycopg.Connection[Any]) -> None:
    """Pin ``conn``'s search_path for the session (committed when not in autocommit)."""
    conn.execute(query("pin_search_path", "public"), prepare=False)
    if not conn.autocommit:
        conn.commit()


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """``psycopg.connect(dsn, **kwargs)``, its search_path pinned before it is handed out."""
    conn = psycopg.connect(dsn, **kwargs)
    try:
        pin(conn)
    except BaseException:
        conn.close()
        raise
    return conn


def pin_transaction(cursor: Any) -> str:
    """Pin the search_path of another tool's transaction (a DBAPI cursor) until it ends, or until
    :func:`restore` gives back what it returns: the path it had."""
    cursor.execute(query("search_path_now", "public").as_string())
    (saved,) = cursor.fetchone()
    cursor.execute(query("pin_search_path_local", "public").as_string())
    return str(saved)


def restore(cursor: Any, saved: str) -> None:
    """Give another tool's transaction back its search_path (what :func:`pin_transaction` saved)."""
    cursor.execute(query("restore_search_path", "public").as_string(), (saved,))
