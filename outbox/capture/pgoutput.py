"""pgoutput's stream, decoded: the positions of an outbox's WAL, and the pieces of committed
transactions that carry its events (logical decoding messages under its prefix, each signed:
:mod:`outbox.capture.wal_message`)."""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from outbox.capture.wal_message import Keys, WalRow, row_of

PIECE_EVENTS = 1_000  # events of a large transaction handed on together at most

_BEGIN = struct.Struct(">QqI")  # final LSN, commit time (microseconds since 2000-01-01 UTC), xid
PG_EPOCH = 946_684_800  # 2000-01-01 UTC in Unix seconds
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

    rows: list[WalRow]  # each event, decoded once (the relay's loop sends it as it is)
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
    keys: Keys | None = None  # the outbox's signing keys (capture_keys)
    rows: list[WalRow] = field(default_factory=list)
    ignored: int = 0  # non-transactional messages passed over (no outbox event is one)
    rotated: bool = False  # a key rotation's message was read: the reader reads the keys again
    _commit: int = 0  # the commit LSN of the transaction being read
    _committed: float = 0.0  # when it committed (epoch): which keys may have signed its messages
    _seen: int = 0  # its events so far (handed on before, emitted in pieces, or in rows)
    _skipping: int = 0  # its first events to drop: handed on before
    _whole_skip: bool = False  # the whole transaction was handed on before
    _pieces: int = 0  # its pieces emitted so far

    def feed(self, data: bytes) -> Piece | None:
        kind = data[:1]
        if kind == b"M":
            # flags (1 byte: 1 = transactional) and the message's LSN (8), then the prefix from
            # byte 10. A non-transactional message (any role may emit one, under any prefix)
            # comes between transactions, committed by nobody: never an event, and kept it
            # would sit in ``rows`` until the next transaction, holding the slot's feedback.
            if not data[1] & 1:
                self.ignored += 1
                return None
            end = data.index(b"\0", 10)
            if data[10:end] != self.prefix or self._whole_skip:
                return None
            self._seen += 1
            if self._seen <= self._skipping:
                return None  # handed on before this stream began
            (length,) = struct.unpack_from(">I", data, end + 1)
            assert self.keys is not None, "a decoder needs the outbox's keys"
            row = row_of(data[end + 5 : end + 5 + length], self.keys, self.prefix, self._committed)
            if row is None:  # a key rotation: later messages may be signed with a key not read yet
                self.rotated = True
                return None
            self.rows.append(row)
            if len(self.rows) >= (self.piece or PIECE_EVENTS):
                return self._emit(Position(self.skip.lsn, self._commit, self._seen))
            return None
        if kind == b"B":
            (final_lsn, committed, _) = _BEGIN.unpack_from(data, 1)
            self.rows, self._seen, self._pieces = [], 0, 0
            self._commit = final_lsn
            self._committed = PG_EPOCH + committed / 1e6
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
