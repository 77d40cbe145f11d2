"""The WAL reader: a thread per outbox in WAL capture that streams its replication slot on a
session of its own and queues committed transactions for the relay's loop."""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import psycopg

from outbox.capture.mode import CaptureState, prefix_of, state
from outbox.capture.pgoutput import Decoder, Piece, Position, lsn_int, lsn_text
from outbox.capture.wal_message import Keys, WalRow
from outbox.extras import require
from outbox.observe.conditions import Condition
from outbox.store import pinning
from outbox.store.dsn import scrub, secrets_of
from outbox.store.queries import query, raw

log = logging.getLogger("outbox.capture")
WAL_READER = "WAL capture's reader (a replication connection)"  # what needs outbox-relay[psycopg2]

QUEUE_EVENTS = 20_000  # events read ahead of the relay at most (then the reader waits)
STANDBY_RETRY = 1.0  # seconds between tries of a slot another relay reads
RECONNECT = 1.0  # seconds before reading again after the connection failed
FEEDBACK_EVERY = 1.0  # seconds between the reader's position reports while it is idle
FEEDBACK_MIN = 0.1  # seconds at least between its reports of what was handed on


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
        require("psycopg2", WAL_READER)
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
        self._fields = fields
        self._server: tuple[str, int] | None = None  # (host:port, timeline) streamed last
        self._lost = False  # the slot was found missing (said once, until it is read again)

    # -- the relay loop's side --

    def take(self, limit: int) -> tuple[list[WalRow], Position] | None:
        """Pieces in order, up to ``limit`` events (at least one piece): their rows, and the
        position once they are handed on. None when none waits."""
        with self._lock:
            if not self._queue:
                return None
            rows: list[WalRow] = []
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
            except psycopg2.errors.UndefinedObject as exc:  # "replication slot ... does not exist"
                self.reading = False
                self._slot_lost(scrub(str(exc).strip(), secrets_of(self.dsn)))
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
            except Exception as exc:  # a bug, not the network: the thread must not die unseen
                self.reading = False
                self._failed_unexpectedly(exc)
                self._halt.wait(RECONNECT)

    def _failed_unexpectedly(self, exc: Exception) -> None:
        """An error no clause above expects. A reader thread that died of it left its condition
        as it was (ready, while nothing was read); so it is a failure like the others, with its
        traceback once an episode (secrets scrubbed), and the reader tries again."""
        secrets = secrets_of(self.dsn)
        if not self.condition.active:
            log.error(
                "%sthe WAL reader failed unexpectedly, trying again: %s",
                self._said,
                scrub(f"{type(exc).__name__}: {exc}", secrets),
                extra={
                    "event": "wal.reader_failed",
                    "detail": scrub(traceback.format_exc().strip(), secrets),
                    **self._fields,
                },
            )
        self.condition.fail(scrub(f"the reader failed: {type(exc).__name__}: {exc}", secrets), said=True)

    def _slot_lost(self, error: str) -> None:
        """The slot is not on the server: after a failover to a standby that did not synchronise
        it, or dropped. What was committed after the position handed on and not read is lost
        with it. Said once (until the slot is read again); /readyz names it meanwhile."""
        lost = f"the WAL slot {self.slot} is lost: {error}"
        said = not self._lost
        if said:
            self._lost = True
            log.error(
                "%s%s; delivered: every event committed up to WAL position %s%s. Events committed "
                "after it and not read are lost with the slot (docs/wal-capture.md, A lost slot)",
                self._said, lost, lsn_text(self._done.lsn),
                f" (the last read at {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.last_commit))} UTC)"
                if self.last_commit else "",
                extra={"event": "wal.slot_lost", **self._fields},
            )  # fmt: skip
        self.condition.fail(lost, said=said)  # an episode it starts: that line was its start

    @staticmethod
    def _server_of(cur: Any, conn: Any) -> tuple[str, int]:
        """(host:port, timeline) of the server a replication connection reached."""
        cur.execute(raw("identify_system"))
        row = cur.fetchone()
        return f"{conn.info.host}:{conn.info.port}", int(row[1]) if row else 0

    def _streaming_on(self, server: tuple[str, int]) -> None:
        """The slot is streamed on ``server``: said once when that is another server than before
        (a failover to a standby that synchronised the slot)."""
        if self._server is not None and server != self._server:
            log.warning(
                "%sthe WAL slot %s found on %s (timeline %d; it was read on %s, timeline %d): "
                "reading on from WAL position %s",
                self._said, self.slot, server[0], server[1], self._server[0], self._server[1],
                lsn_text(self._done.lsn), extra={"event": "wal.failover", **self._fields},
            )  # fmt: skip
        self._server = server
        self._lost = False

    def _keys(self, db: psycopg.Connection[Any]) -> Keys:
        rows = db.execute(query("capture_keys", self.schema)).fetchall()
        if not rows:
            raise psycopg.DataError(f"{self.schema}.capture_keys is empty: run `outbox migrate`")
        return Keys([(bytes(key), retire) for key, retire in rows])

    def _stream(self) -> None:
        import psycopg2
        import psycopg2.extras

        conn = psycopg2.connect(
            self.dsn,
            connection_factory=psycopg2.extras.LogicalReplicationConnection,
            application_name="outbox-wal",
            options=pinning.REPLICATION_OPTIONS,
        )
        sent = 0
        cur = conn.cursor()
        try:
            # Where the outbox's WAL is handed on up to, as committed (by this relay, or by the
            # reader that held the slot before it: the slot's own position may lag behind it).
            with pinning.connect(self.dsn, autocommit=True, application_name="outbox-wal") as db:
                handed = state(db, self.schema).position
                end = db.execute(query("current_wal_lsn", self.schema)).fetchone()
                keys = self._keys(db)
            target = lsn_int(end[0]) if end else 0  # caught up once the server has sent this far
            self.confirm(handed)
            server = self._server_of(cur, conn)
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
            decoder = Decoder(prefix_of(self.schema).encode(), skip=self._done, keys=keys)
            if self.standing_by:
                log.info(
                    "%staking over the WAL slot %s", self._said, self.slot, extra={"event": "wal.takeover"}
                )
            self.standing_by, self.reading = False, True
            self._streaming_on(server)
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
                if decoder.rotated:  # committed before anything its new key signs: read them now
                    with pinning.connect(self.dsn, autocommit=True, application_name="outbox-wal") as db:
                        decoder.keys = self._keys(db)
                    decoder.rotated = False
                    log.info("%sthe signing key was rotated: keys read again", self._said,
                             extra={"event": "wal.keys"})  # fmt: skip
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
