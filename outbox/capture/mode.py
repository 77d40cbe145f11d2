"""WAL capture: events written only to the WAL, read from a replication slot.

In WAL mode ``enqueue`` does not insert a row: it emits one transactional logical decoding
message per event (``pg_logical_emit_message(true, prefix, content)``), decoded only if the
transaction commits, and in commit order. No heap row, no index entry, no dead tuple, no
vacuum. The relay reads the messages from the outbox's logical replication slot (plugin
``pgoutput``, with its ``messages`` option: PostgreSQL 14+) and sends them through the same
sinks, spans and metrics as claimed rows (:class:`WalBatch`).

What is not delivered at once goes into the events table, in commit order, and the table's
machinery (backoff, dead letters, parking, per-key order) takes it from there: a failed event,
and every later event of its key while the key has anything in the table, so a key never
overtakes its own failure. The slot's position advances past a transaction only once its
events are delivered and archived, or in the table, in a transaction that committed; that
transaction also records the position in ``capture_positions``, below which a relay skips what the
slot sends again (after a crash between that commit and the slot's confirmation).

One relay reads a slot at a time (PostgreSQL lets one session stream it): the others stand by
and take over when the reader's session ends. So the order is commit order.

Each message is signed by the outbox's ``emit_events`` function; its format, its signature and
what the reader makes of a message that is not an event are :mod:`outbox.capture.wal_message`'s.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.capture.pgoutput import Decoder, Piece, Position, lsn_int, lsn_text
from outbox.errors import ConfigError
from outbox.store.queries import query

__all__ = ["MODES", "CaptureState", "Decoder", "Piece", "Position", "lsn_int", "lsn_text", "state", "switch"]

log = logging.getLogger("outbox.capture")

MODES = ("table", "wal")
MIN_SERVER = 140000  # pgoutput's `messages` option
FAILOVER_SERVER = 170000  # slots that can be synchronised to standbys (failover = true)


def prefix_of(schema: str) -> str:
    """The logical message prefix of an outbox's events (the decoder keeps only these)."""
    return f"outbox:{schema}"


def _name(kind: str, schema: str, distinct: str | None = None) -> str:
    """A slot or publication name for ``schema``: lower-case letters, digits and underscores
    (what slot names allow), at most 63 bytes, distinct per ``distinct`` (the schema's name)."""
    clean = re.sub(r"[^a-z0-9_]", "_", schema.lower())[:40]
    return f"outbox_{kind}_{clean}_{hashlib.sha256((distinct or schema).encode()).hexdigest()[:8]}"


def slot_name(schema: str, database: str) -> str:
    """The slot a switch to WAL capture makes for ``schema`` of ``database``. Slots are the
    server's, not a database's: two databases with an outbox in a schema of one name (each its
    own ``outbox``) need two, and the second switch took the first's (its relay then had no slot
    in its database, and read nothing). A slot made before keeps its name, recorded in the
    outbox's capture table (:func:`slot_names`)."""
    return _name("slot", schema, f"{database}\0{schema}")


def slot_names(schema: str, database: str) -> tuple[str, str]:
    """The names an outbox's slot may have: this version's, and the name earlier versions gave a
    slot from the schema alone (kept by an existing outbox)."""
    return slot_name(schema, database), _name("slot", schema)


def publication_name(schema: str) -> str:
    return _name("pub", schema)


# -- switching an outbox (outbox migrate --capture) ------------------------------------------


@dataclass
class CaptureState:
    mode: str = "table"
    slot: str | None = None
    publication: str | None = None
    lsn: str | None = None  # handed on up to here
    part_commit: str | None = None  # and the first part_events of the transaction committed here
    part_events: int = 0

    @property
    def position(self) -> Position:
        return Position(
            lsn_int(self.lsn) if self.lsn else 0,
            lsn_int(self.part_commit) if self.part_commit else 0,
            self.part_events if self.part_commit else 0,
        )

    @property
    def reads_slot(self) -> bool:
        """Has this outbox a slot to read (WAL mode, or switched back with the slot kept)?"""
        return self.slot is not None


def state(conn: psycopg.Connection[Any], schema: str) -> CaptureState:
    """The outbox's capture state (table mode for an outbox migrated before 0013)."""
    row = conn.execute(query("capture_table_exists", schema), {"schema": schema}).fetchone()
    if not row or not row[0]:
        return CaptureState()
    row = conn.execute(query("capture_state", schema)).fetchone()
    if row is None:
        return CaptureState()
    return CaptureState(*row)


def switch(conn: psycopg.Connection[Any], schema: str, mode: str, *, drop_slot: bool = False) -> str:
    """Switch ``schema``'s outbox to ``mode`` on an autocommit connection; return what was done,
    one line. WAL mode: refuses unless ``wal_level`` is logical on PostgreSQL 14+; creates the
    publication and the slot when missing. Table mode keeps the slot unless ``drop_slot`` (the
    relay reads what writers that still run in WAL mode emit; drop it once none do)."""
    if mode not in MODES:
        raise ConfigError(f"--capture: expected one of {', '.join(MODES)}, got {mode!r}")
    current = state(conn, schema)
    publication = publication_name(schema)
    if mode == "table":
        if drop_slot and current.slot is not None:
            if conn.execute(query("slot_of", schema), {"slot": current.slot}).fetchone():
                conn.execute(query("drop_slot", schema), {"slot": current.slot})
            if current.publication is not None:
                conn.execute(
                    query("drop_publication", schema, identifiers={"publication": current.publication})
                )
            conn.execute(query("set_capture", schema), {"mode": "table", "slot": None, "publication": None})
            return f"schema {schema}: table capture; slot {current.slot} and its publication dropped"
        conn.execute(
            query("set_capture", schema),
            {"mode": "table", "slot": current.slot, "publication": current.publication},
        )
        kept = f"; slot {current.slot} kept (drop it with --drop-slot)" if current.slot else ""
        return f"schema {schema}: table capture{kept}"
    row = conn.execute(query("wal_level", schema)).fetchone()
    assert row is not None
    level, version, database = str(row[0]), int(row[1]), str(row[2])
    slot = current.slot or slot_name(schema, database)  # one made before keeps its name
    found = conn.execute(query("slot_of", schema), {"slot": slot}).fetchone()
    if found is not None and found[1] != database:
        raise ConfigError(
            f"--capture wal: the replication slot {slot} exists, but in database {found[1]}: a slot "
            f"reads one database; drop it there, or give this outbox's schema another name"
        )
    if level != "logical":
        raise ConfigError(
            f"--capture wal: the server's wal_level is {level}, not logical; set it with ALTER SYSTEM "
            "SET wal_level = logical (or in postgresql.conf) and restart PostgreSQL"
        )
    if version < MIN_SERVER:
        raise ConfigError(
            f"--capture wal: needs PostgreSQL 14 or later (pgoutput's messages); "
            f"this server is {version // 10000}"
        )
    made = []
    exists = conn.execute(query("publication_exists", schema), {"publication": publication}).fetchone()
    if not exists or not exists[0]:
        conn.execute(query("create_publication", schema, identifiers={"publication": publication}))
        made.append(f"publication {publication}")
    if found is None:
        name = "create_slot_failover" if version >= FAILOVER_SERVER else "create_slot"
        conn.execute(query(name, schema), {"slot": slot})
        made.append(f"slot {slot}")
    conn.execute(query("set_capture", schema), {"mode": "wal", "slot": slot, "publication": publication})
    return (
        f"schema {schema}: WAL capture"
        + (f"; created {', '.join(made)}" if made else "")
        + f"; events are signed by {schema}.emit_events (writers need EXECUTE on it: --roles grants "
        f"it to the writer role); not revoked: pg_logical_emit_message, which every role may run as "
        f"PostgreSQL ships it, so any role can still write WAL messages under {prefix_of(schema)}, "
        "but the relay dead-letters them as unsigned_event, never delivers them"
    )


ROTATION_WINDOW = 3600.0  # seconds, by default, the old key verifies what commits after a rotation
# seconds at least: a reader that reads a transaction before the rotation's message, and one that
# starts after the rotation and judges it by its commit time, must judge it alike; a window of 0 s
# refused, on a restart, what a writer signed while the rotation committed, which the live reader
# had delivered (issue 70). A minute covers any rotation's own transaction and a writer's in flight.
MIN_ROTATION_WINDOW = 60.0
KEY_DROP_MARGIN = 1.0  # seconds after a key's window before the WAL's end counts as past it


@dataclass(frozen=True)
class Rotation:
    """What ``rotate_key`` did: the new key's id, the keys it retired (id, when they stop), the
    old keys it dropped (past their window, and read past in the WAL)."""

    new: int
    retired: list[tuple[int, Any]]
    dropped: list[int]


def check_window(window: float) -> None:
    """ConfigError unless ``window`` is one a rotation may take (:data:`MIN_ROTATION_WINDOW`)."""
    if not window >= MIN_ROTATION_WINDOW:
        raise ConfigError(
            f"--window: must be at least {MIN_ROTATION_WINDOW:g} seconds (a writer that read the old key "
            f"just before the rotation commits within it), got {window:g}"
        )


def rotate_key(conn: psycopg.Connection[Any], schema: str, window: float = ROTATION_WINDOW) -> Rotation:
    """Rotate the outbox's WAL signing key, in one transaction: a new key signs from the commit
    on; the one before verifies what commits within ``window`` seconds, then nothing; a message
    of the rotation, signed with the old key, tells every reader to read the keys again (in WAL
    order, before anything the new key signs). Keys retired earlier are dropped once the slot is
    confirmed past every message they could have signed (``passed_lsn``, migration 0026)."""
    check_window(window)
    with conn.transaction():
        row = conn.execute(query("capture_key_add", schema)).fetchone()
        assert row is not None
        new, old = int(row[0]), int(row[1])
        conn.execute(query("capture_key_rotated", schema), {"new": new, "old": old})
        conn.execute(query("capture_key_current", schema), {"new": new})
        conn.execute(query("capture_keys_passed", schema), {"margin": KEY_DROP_MARGIN})
        dropped = [int(i) for (i,) in conn.execute(
            query("capture_keys_drop", schema), {"slot": state(conn, schema).slot}
        ).fetchall()]  # fmt: skip
        retired = [(int(i), at) for i, at in conn.execute(
            query("capture_key_retire", schema), {"new": new, "window": float(window)}
        ).fetchall()]  # fmt: skip
    return Rotation(new, retired, sorted(dropped))
