"""A sample app under load: each business transaction writes an order and its event.

Writer threads commit, at a steady total ``rate``, one row in the business
table ``orders`` and one event (``enqueue``) per transaction. Every key is
written by one thread with a rising sequence number, so a consumer can check
per-key order; the event's payload is JSON carrying both, as an app's would.

What each commit became is kept: ``committed`` (the commit returned),
``rolled_back`` (the app rolled it back on purpose, ``rollback_every``), and
``unsure`` (the connection broke during COMMIT: the database decides). The
writers reconnect by themselves, so the load survives a database restart.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import random
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox.store.queries import query
from outbox.write.writer import enqueue

MiB = 1 << 20
CONNECT_TIMEOUT = 3  # seconds


@dataclass
class Written:
    event_id: str
    key: str
    seq: int
    at: float  # wall-clock time the commit returned


def payload(key: str, seq: int, amount: int) -> dict[str, Any]:
    """The event an order writes: JSON, as an app's would be."""
    return {"key": key, "seq": seq, "amount": amount, "currency": "EUR", "status": "placed"}


def decode(value: bytes | None) -> tuple[str, int]:
    """(key, seq) of a consumed payload written by :func:`payload`; ("", 0) when it is not one."""
    try:
        body = json.loads(value or b"{}")
        return str(body.get("key", "")), int(body.get("seq", 0))
    except (ValueError, AttributeError):
        return "", 0


def prepare(dsn: str, schema: str) -> None:
    """Create the business table next to the outbox (the schema is migrated already)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(query("harness_orders_table", schema))


@dataclass
class Load:
    """Writer threads committing ``rate`` business transactions per second in all."""

    dsn: str
    schema: str
    topic: str
    rate: float
    writers: int = 2
    keys: int = 200
    rollback_every: int = 0  # every n-th transaction of a writer is rolled back on purpose (0: none)
    seconds: float | None = None  # stop by itself after this long (None: at stop())
    committed: list[Written] = field(default_factory=list)
    rolled_back: list[Written] = field(default_factory=list)
    unsure: list[Written] = field(default_factory=list)  # the commit failed with the connection
    errors: int = 0
    last_error: str = ""  # the last error's first line (diagnostics: why the load fell short)
    crashed: str = ""  # a writer thread that died of an unexpected exception: its repr
    slowest_commit: float = 0.0  # seconds, the longest business transaction (a loaded machine)

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ValueError(f"rate: must be > 0, got {self.rate}")
        self.stop_event = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"load-{i}", daemon=True)
            for i in range(self.writers)
        ]

    def start(self) -> Load:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self.stop_event.set()
        self.join()

    def join(self, timeout: float = 30.0) -> None:
        for t in self._threads:
            t.join(timeout)

    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @property
    def count(self) -> int:
        return len(self.committed)

    def _connect(self) -> psycopg.Connection[Any] | None:
        while not self.stop_event.is_set():
            try:
                return psycopg.connect(
                    self.dsn, connect_timeout=CONNECT_TIMEOUT, application_name="harness-app"
                )
            except psycopg.OperationalError as exc:
                self.errors += 1
                self.last_error = "connect: " + _first_line(exc)
                self.stop_event.wait(0.2)
        return None

    def _run(self, index: int) -> None:
        try:
            self._write(index)
        except Exception as exc:  # recorded, so that a run that fell short says why
            self.crashed = f"writer {index}: {exc!r}"
            raise

    def _write(self, index: int) -> None:
        keys = [f"key-{k}" for k in range(index, self.keys, self.writers)]  # each key has one writer
        if not keys:
            return
        seqs = dict.fromkeys(keys, 0)
        insert = query("harness_insert_order", self.schema)
        interval = self.writers / self.rate
        rng = random.Random()
        conn = self._connect()
        started = next_at = time.monotonic()
        n = 0
        while conn is not None and not self.stop_event.is_set():
            if self.seconds is not None and time.monotonic() - started >= self.seconds:
                break
            key = keys[n % len(keys)]
            n += 1
            rollback = bool(self.rollback_every) and n % self.rollback_every == 0
            amount = rng.randint(5, 500)
            seq = seqs[key] + (0 if rollback else 1)
            event_id: str | None = None
            began = time.monotonic()
            try:
                with conn.transaction():
                    conn.execute(insert, (key, seq, amount))
                    event_id = str(
                        enqueue(conn, self.topic, payload(key, seq, amount), key=key, schema=self.schema)
                    )
                    if rollback:
                        raise _Rollback
                seqs[key] = seq
                self.slowest_commit = max(self.slowest_commit, time.monotonic() - began)
                with self._lock:
                    self.committed.append(Written(event_id, key, seq, time.time()))
            except _Rollback:
                with self._lock:
                    self.rolled_back.append(Written(str(event_id), key, seq, time.time()))
            except psycopg.Error as exc:
                self.errors += 1
                self.last_error = _first_line(exc)
                if event_id is not None:  # failed at COMMIT: the outcome is unknown
                    seqs[key] = seq
                    with self._lock:
                        self.unsure.append(Written(event_id, key, seq, time.time()))
                with contextlib.suppress(Exception):
                    conn.close()
                conn = self._connect()
                next_at = time.monotonic()
                continue
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                self.stop_event.wait(delay)
            elif delay < -1.0:
                next_at = time.monotonic()  # fell behind (an outage): do not burst to catch up
        if conn is not None:
            conn.close()

    def poison(self, n: int) -> list[Written]:
        """Commit events no broker can take: every other one too large, the rest to invalid topics."""
        out = []
        with psycopg.connect(self.dsn) as conn:
            for i in range(n):
                key = f"poison-{uuid.uuid4().hex[:8]}"  # its own key: parks nothing else
                if i % 2 == 0:
                    eid = enqueue(conn, self.topic, os.urandom(2 * MiB), key=key, schema=self.schema)
                else:
                    eid = enqueue(conn, "not a valid topic!", b"x", key=key, schema=self.schema)
                conn.commit()
                out.append(Written(str(eid), key, 0, time.time()))
        return out


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else repr(exc)


class _Rollback(Exception):
    """The sample app's business rule failed: roll the transaction back."""


def _load_process(
    dsn: str,
    schema: str,
    topic: str,
    rate: float,
    writers: int,
    keys: int,
    stop: Any,  # multiprocessing.Event
    out: Any,  # multiprocessing.connection.Connection
) -> None:
    """The sample app in a process of its own: its commits sent to the parent every 0.1 s."""
    load = Load(dsn, schema, topic, rate=rate, writers=writers, keys=keys).start()
    sent = {"committed": 0, "unsure": 0, "rolled_back": 0}

    def flush() -> None:
        with load._lock:
            batch = {name: list(getattr(load, name)[n:]) for name, n in sent.items()}
        for name, items in batch.items():
            sent[name] += len(items)
        stats = {
            "errors": load.errors,
            "last_error": load.last_error,
            "crashed": load.crashed,
            "slowest_commit": load.slowest_commit,
        }
        out.send((batch, stats))

    while not stop.wait(0.1):
        flush()
        if not load.alive():
            break
    load.stop()
    flush()
    out.send(None)
    out.close()


class LoadProcess:
    """:class:`Load` in a process of its own, as an app is: a busy observer in the harness's
    process (a webhook receiver taking every delivery, a proxy) cannot slow its commits through
    the GIL. The same attributes as :class:`Load`, kept up to date every 0.1 s."""

    def __init__(
        self, dsn: str, schema: str, topic: str, rate: float, writers: int = 2, keys: int = 200
    ) -> None:
        if not rate > 0:
            raise ValueError(f"rate: must be > 0, got {rate}")
        self.dsn, self.schema, self.topic = dsn, schema, topic
        self.committed: list[Written] = []
        self.rolled_back: list[Written] = []
        self.unsure: list[Written] = []
        self.errors = 0
        self.last_error = ""
        self.crashed = ""
        self.slowest_commit = 0.0
        self._lock = threading.Lock()
        ctx = mp.get_context("spawn")
        self._stop = ctx.Event()
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_load_process,
            args=(dsn, schema, topic, rate, writers, keys, self._stop, send),
            name="harness-app",
            daemon=True,
        )
        self._send = send
        self._reader = threading.Thread(target=self._read, name="harness-app-reader", daemon=True)

    def start(self) -> LoadProcess:
        self._proc.start()
        self._send.close()  # the child's end: EOF here once the child is gone
        self._reader.start()
        return self

    def _read(self) -> None:
        while True:
            try:
                msg = self._recv.recv()
            except (EOFError, OSError):
                return
            if msg is None:
                return
            batch, stats = msg
            with self._lock:
                for name, items in batch.items():
                    getattr(self, name).extend(items)
                self.errors = stats["errors"]
                self.last_error = stats["last_error"]
                self.crashed = stats["crashed"]
                self.slowest_commit = stats["slowest_commit"]

    @property
    def count(self) -> int:
        return len(self.committed)

    def alive(self) -> bool:
        return self._proc.is_alive()

    def stop(self) -> None:
        self._stop.set()
        self._proc.join(60)
        self._reader.join(10)
        if self._proc.exitcode not in (0, None) and not self.crashed:
            self.crashed = f"the app's process exited with code {self._proc.exitcode}"

    def poison(self, n: int) -> list[Written]:
        """As :meth:`Load.poison` (a connection of the harness's own)."""
        return Load(self.dsn, self.schema, self.topic, rate=1, writers=1).poison(n)
