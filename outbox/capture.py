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
what the reader makes of a message that is not an event are :mod:`outbox.wal_message`'s.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import re
import select
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox.conditions import Condition
from outbox.dsn import scrub, secrets_of
from outbox.errors import ConfigError
from outbox.extras import require
from outbox.queries import query
from outbox.wal_message import Signer, row_of

log = logging.getLogger("outbox.capture")

MODES = ("table", "wal")
MIN_SERVER = 140000  # pgoutput's `messages` option
FAILOVER_SERVER = 170000  # slots that can be synchronised to standbys (failover = true)
QUEUE_EVENTS = 20_000  # events read ahead of the relay at most (then the reader waits)
PIECE_EVENTS = 1_000  # events of a large transaction handed on together at most
STANDBY_RETRY = 1.0  # seconds between tries of a slot another relay reads
RECONNECT = 1.0  # seconds before reading again after the connection failed
FEEDBACK_EVERY = 1.0  # seconds between the reader's position reports while it is idle
FEEDBACK_MIN = 0.1  # seconds at least between its reports of what was handed on


def prefix_of(schema: str) -> str:
    """The logical message prefix of an outbox's events (the decoder keeps only these)."""
    return f"outbox:{schema}"


def _name(kind: str, schema: str) -> str:
    """A slot or publication name for ``schema``: lower-case letters, digits and underscores
    (what slot names allow), at most 63 bytes, distinct per schema."""
    clean = re.sub(r"[^a-z0-9_]", "_", schema.lower())[:40]
    return f"outbox_{kind}_{clean}_{hashlib.sha256(schema.encode()).hexdigest()[:8]}"


def slot_name(schema: str) -> str:
    return _name("slot", schema)


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
    slot, publication = slot_name(schema), publication_name(schema)
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
    level, version = str(row[0]), int(row[1])
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
    if not conn.execute(query("slot_of", schema), {"slot": slot}).fetchone():
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


# -- pgoutput ---------------------------------------------------------------------------------

_BEGIN = struct.Struct(">QqI")  # final LSN, commit time, xid
_COMMIT = struct.Struct(">BQQq")  # flags, commit LSN, end LSN, commit time


def lsn_text(lsn: int) -> str:
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def lsn_int(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) | int(low, 16)


@dataclass(frozen=True)
class Position:
    """How far an outbox's WAL is handed on: every transaction ending at or before ``lsn``, and,
    when ``commit`` is set, the first ``events`` events of the transaction whose commit record
    starts at ``commit`` (a large transaction is handed on in pieces). Only ``lsn`` may be
    confirmed to the slot: the server sends a transaction whole or not at all."""

    lsn: int = 0
    commit: int = 0
    events: int = 0

    @property
    def key(self) -> tuple[int, int]:
        """Orders positions: a transaction's pieces before its end, its end before the next one."""
        return (self.commit, self.events) if self.commit else (self.lsn, 0)

    def __ge__(self, other: Position) -> bool:
        return self.key >= other.key

    def __gt__(self, other: Position) -> bool:
        return self.key > other.key


@dataclass
class Piece:
    """Committed events of this outbox, in commit order: a whole transaction, or a piece of a
    large one (at most ``PIECE_EVENTS``). ``after`` is the position once they are handed on."""

    rows: list[tuple[Any, ...]]
    after: Position
    whole: bool = True  # a whole transaction, not a piece of one
    queued_at: float = 0.0  # monotonic time it was read


@dataclass
class Decoder:
    """Assembles pgoutput's stream into pieces of committed transactions of this outbox's events.

    The server sends a transaction only once it committed (pgoutput without streaming), so the
    pieces of one can go out before its commit message arrives: a large transaction is handed
    on ``PIECE_EVENTS`` at a time, never held in memory whole. ``skip`` is what was handed on
    before: whole transactions up to it are dropped, and so are the first events of the one it
    names (the slot sends from its confirmed position, which may be behind)."""

    prefix: bytes
    skip: Position = field(default_factory=Position)
    piece: int = 0  # events per piece at most (0: PIECE_EVENTS)
    key: bytes = b""  # the outbox's signing key (capture_key)
    rows: list[tuple[Any, ...]] = field(default_factory=list)
    _commit: int = 0  # the commit LSN of the transaction being read
    _seen: int = 0  # its events so far (handed on before, emitted in pieces, or in rows)
    _skipping: int = 0  # its first events to drop: handed on before
    _whole_skip: bool = False  # the whole transaction was handed on before
    _pieces: int = 0  # its pieces emitted so far
    _signer: Signer = field(init=False)

    def __post_init__(self) -> None:
        self._signer = Signer(self.key)

    def feed(self, data: bytes) -> Piece | None:
        kind = data[:1]
        if kind == b"M":
            # flags (1 byte) and the message's LSN (8), then the prefix from byte 10
            end = data.index(b"\0", 10)
            if data[10:end] != self.prefix or self._whole_skip:
                return None
            self._seen += 1
            if self._seen <= self._skipping:
                return None  # handed on before this stream began
            (length,) = struct.unpack_from(">I", data, end + 1)
            self.rows.append(row_of(data[end + 5 : end + 5 + length], self._signer, self.prefix))
            if len(self.rows) >= (self.piece or PIECE_EVENTS):
                return self._emit(Position(self.skip.lsn, self._commit, self._seen))
            return None
        if kind == b"B":
            (final_lsn, _, _) = _BEGIN.unpack_from(data, 1)
            self.rows, self._seen, self._pieces = [], 0, 0
            self._commit = final_lsn
            # Handed on whole before: its commit record starts before the end of one that was.
            self._whole_skip = final_lsn < self.skip.lsn
            self._skipping = self.skip.events if final_lsn == self.skip.commit else 0
            return None
        if kind == b"C":
            _, _, end_lsn, _ = _COMMIT.unpack_from(data, 1)
            if self._whole_skip:
                self.rows = []
                return None
            self.skip = Position(end_lsn)
            # Its last piece carries the end (even empty, when earlier pieces went out); a
            # transaction with nothing of ours is an empty piece too: the slot may move past it.
            return self._emit(Position(end_lsn))
        return None  # relations, origins, types: no table is published

    def _emit(self, after: Position) -> Piece:
        piece = Piece(self.rows, after, whole=not self._pieces and not after.commit)
        self.rows = []
        self._pieces += 1
        return piece


# -- the reader ---------------------------------------------------------------------------------


class WalReader(threading.Thread):
    """Streams one outbox's slot on a session of its own and queues committed transactions.

    The relay loop takes events with :meth:`take` and reports, with :meth:`confirm`, the
    position up to which they are handed on; the reader passes it to the server. When another
    relay streams the slot, this one stands by and tries again every ``STANDBY_RETRY`` s."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        capture: CaptureState,
        wake: Callable[[], None],
        *,
        name: str = "",
    ) -> None:
        super().__init__(name=f"outbox-wal-{schema}", daemon=True)
        assert capture.slot is not None and capture.publication is not None
        require("psycopg2", "WAL capture's reader (a replication connection)")
        self.dsn = dsn
        self.schema = schema
        self.slot = capture.slot
        self.publication = capture.publication
        self._wake = wake
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self._queue: deque[Piece] = deque()
        self._queued = 0  # events in the queue
        self._room = threading.Condition(self._lock)
        # Handed on (committed) up to here; the slot may be confirmed up to its whole transactions.
        self._done = capture.position
        self._read = self._done  # queued (or skipped) up to here
        self._rewind = False  # set by rewind(): reconnect and read from the confirmed position
        self.reading = False  # this relay streams the slot (the others stand by)
        self.caught_up = False  # since it began streaming, it has read all the server had sent
        self.standing_by = False
        self.last_commit = 0.0  # wall time the last transaction read was read
        said = f"outbox {name}: " if name else ""
        fields = {"outbox": name} if name else {}
        self.condition = Condition(
            log, "wal", f"{said}reading the WAL slot {self.slot} failing", fields=fields
        )
        self._said = said

    # -- the relay loop's side --

    def take(self, limit: int) -> tuple[list[tuple[Any, ...]], Position] | None:
        """Pieces in order, up to ``limit`` events (at least one piece): their rows, and the
        position once they are handed on. None when none waits."""
        with self._lock:
            if not self._queue:
                return None
            rows: list[tuple[Any, ...]] = []
            after = self._queue[0].after
            while self._queue and (not rows or len(rows) + len(self._queue[0].rows) <= limit):
                piece = self._queue.popleft()
                rows.extend(piece.rows)
                after = piece.after
            self._queued -= len(rows)
            self._room.notify()
            return rows, after

    @property
    def waiting(self) -> bool:
        return bool(self._queue)

    @property
    def queued(self) -> int:
        """Events read and not taken yet."""
        return self._queued

    def oldest_wait(self) -> float:
        """Seconds the oldest piece read has waited to be taken (0: none waits)."""
        with self._lock:
            return time.monotonic() - self._queue[0].queued_at if self._queue else 0.0

    def confirm(self, position: Position) -> None:
        """Everything up to ``position`` is handed on, committed: the server may free the WAL of
        the whole transactions before it."""
        with self._lock:
            if position > self._done:
                self._done = position

    def rewind(self) -> None:
        """What was taken was not handed on (a batch rolled back): read again from the slot's
        confirmed position (the reader reconnects; what was handed on before is skipped)."""
        with self._lock:
            self._rewind = True
            self._queue.clear()
            self._queued = 0
            self._room.notify_all()

    def stop(self) -> None:
        self._halt.set()
        with self._lock:
            self._room.notify_all()

    # -- the reader's thread --

    def run(self) -> None:
        import psycopg2
        import psycopg2.errors

        while not self._halt.is_set():
            try:
                self._stream()
            except psycopg.Error as exc:  # reading the position
                self.reading = False
                self.condition.fail(scrub(str(exc).strip(), secrets_of(self.dsn)))
                self._halt.wait(RECONNECT)
            except psycopg2.errors.ObjectInUse:
                if not self.standing_by:
                    log.info(
                        "%sanother relay reads the WAL slot %s: standing by",
                        self._said,
                        self.slot,
                        extra={"event": "wal.standby"},
                    )
                self.standing_by, self.reading = True, False
                self._halt.wait(STANDBY_RETRY)
            except psycopg2.Error as exc:
                self.reading = False
                self.condition.fail(scrub(str(exc).strip(), secrets_of(self.dsn)))
                self._halt.wait(RECONNECT)

    def _stream(self) -> None:
        import psycopg2
        import psycopg2.extras

        conn = psycopg2.connect(
            self.dsn,
            connection_factory=psycopg2.extras.LogicalReplicationConnection,
            application_name="outbox-wal",
        )
        sent = 0
        cur = conn.cursor()
        try:
            # Where the outbox's WAL is handed on up to, as committed (by this relay, or by the
            # reader that held the slot before it: the slot's own position may lag behind it).
            with psycopg.connect(self.dsn, autocommit=True, application_name="outbox-wal") as db:
                handed = state(db, self.schema).position
                end = db.execute(query("current_wal_lsn", self.schema)).fetchone()
                signing = db.execute(query("capture_key", self.schema)).fetchone()
            if signing is None:
                raise psycopg.DataError(f"{self.schema}.capture_key is empty: run `outbox migrate`")
            target = lsn_int(end[0]) if end else 0  # caught up once the server has sent this far
            self.confirm(handed)
            cur.start_replication(
                slot_name=self.slot,
                decode=False,
                options={"proto_version": "1", "publication_names": self.publication, "messages": "true"},
                status_interval=10,
            )
            # Whatever was queued and not handed on is dropped: the slot sends it again.
            with self._lock:
                self._queue.clear()
                self._queued = 0
                self._read = self._done
                self._rewind = False
            decoder = Decoder(prefix_of(self.schema).encode(), skip=self._done, key=bytes(signing[0]))
            if self.standing_by:
                log.info(
                    "%staking over the WAL slot %s", self._said, self.slot, extra={"event": "wal.takeover"}
                )
            self.standing_by, self.reading = False, True
            self.condition.ok()
            last_feedback = asked = time.monotonic()
            while not self._halt.is_set() and not self._rewind:
                msg = cur.read_message()
                if msg is None:
                    done = self._done
                    quiet = not self._queue and decoder.rows == []  # nothing read waits
                    idle = quiet and done >= self._read  # ... nor is in flight
                    if quiet and not self.caught_up:
                        # Caught up once the server says it has decoded and sent up to where the
                        # WAL ended when this stream began (an empty read alone says nothing: the
                        # server may not have sent yet). A keepalive asked for says how far.
                        if cur.wal_end >= target:
                            self.caught_up = True
                        elif time.monotonic() - asked >= FEEDBACK_MIN:
                            cur.send_feedback(reply=True, force=True)  # type: ignore[no-untyped-call]
                            asked = time.monotonic()
                    now = time.monotonic()
                    due = now - last_feedback
                    if (done.lsn > sent and due >= FEEDBACK_MIN) or (idle and due >= FEEDBACK_EVERY):
                        # Idle with nothing queued or in flight: everything the server sent so far
                        # is handled (wal_end is how far it decoded), so the slot may move past
                        # WAL that held no event of this outbox.
                        position = max(done.lsn, cur.wal_end) if idle and not done.commit else done.lsn
                        cur.send_feedback(flush_lsn=position, force=True)  # type: ignore[no-untyped-call]
                        sent, last_feedback = max(sent, position), now
                    select.select([conn], [], [], 0.1)
                    continue
                piece = decoder.feed(msg.payload)
                if piece is None:
                    continue
                self.last_commit = time.time()
                if piece.whole and not piece.rows:
                    with self._lock:
                        if not self._queue and self._done >= self._read:
                            self._done = self._read = piece.after  # nothing of ours: move on
                        continue
                with self._lock:
                    while self._queued >= QUEUE_EVENTS and not self._halt.is_set() and not self._rewind:
                        self._room.wait(0.5)
                    if self._rewind:
                        break
                    piece.queued_at = time.monotonic()
                    self._queue.append(piece)
                    self._queued += len(piece.rows)
                    self._read = piece.after
                self._wake()
        finally:
            self.reading = self.caught_up = False
            if self._done.lsn > sent and not conn.closed:  # what was handed on since the last report
                with contextlib.suppress(psycopg2.Error):
                    cur.send_feedback(flush_lsn=self._done.lsn, force=True)  # type: ignore[no-untyped-call]
            conn.close()
