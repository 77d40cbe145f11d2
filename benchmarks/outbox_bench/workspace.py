"""Where a scenario runs: a fresh migrated schema and topic (:class:`Workspace`), and writer
processes committing business transactions at a rate (:class:`Writers`)."""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import tempfile
import threading
import time
import uuid
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

import psycopg

from outbox import capture
from outbox.harness.infra import create_topic
from outbox.harness.load import Load, prepare
from outbox.store.migrate import migrate
from outbox_bench import events
from outbox_bench.contenders import ContenderSpec
from outbox_bench.queries import query

KEYS = events.KEYS
TOPIC_PARTITIONS = 4
STEADY_GRACE_SECONDS = 120.0  # steady, soak, snapshot: longest the relay runs past the writers' time box


class Workspace:
    """A fresh migrated schema and topic, dropped at the end."""

    def __init__(self, dsn: str, bootstrap: str, label: str) -> None:
        self.dsn = dsn
        self.bootstrap = bootstrap
        suffix = uuid.uuid4().hex[:8]
        self.schema = f"bench_{label}_{suffix}"
        self.topic = f"bench.{label}.{suffix}"

    def __enter__(self) -> Workspace:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            migrate(conn, self.schema)
        prepare(self.dsn, self.schema)
        create_topic(self.bootstrap, self.topic, TOPIC_PARTITIONS)
        return self

    def __exit__(self, *exc: object) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            if capture.state(conn, self.schema).slot is not None:
                capture.switch(conn, self.schema, "table", drop_slot=True)  # and its publication
            conn.execute(query("harness_drop_schema", self.schema))

    def capture_wal(self) -> None:
        """Switch this workspace's outbox to WAL capture (before it is filled)."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            capture.switch(conn, self.schema, "wal")

    def fill(self, n: int, label: str, *, shape: str = "realistic", analyze: bool = False) -> float:
        """``n`` events written; the CPU seconds the server spent writing them (see events.fill)."""
        return events.fill(self.dsn, self.schema, self.topic, n, label, shape=shape, analyze=analyze)

    def plain_tables(self, *, analyze: bool, move: bool = True) -> None:
        """The ceiling's plain tables, holding the events just filled (moved out of the outbox),
        or (``move=False``) empty."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(query("ceiling_tables", self.schema))
            if move:
                conn.execute(query("ceiling_fill", self.schema))
            if analyze:
                conn.execute(query("ceiling_analyze", self.schema))

    def spec(self, kind: str, **relay_options: Any) -> ContenderSpec:
        return ContenderSpec(kind, self.dsn, self.schema, self.bootstrap, dict(relay_options))


def _writer_proc(
    dsn: str,
    schema: str,
    topic: str,
    rate: float,
    seconds: float,
    written: Synchronized[int],
    out_path: str | None,
) -> None:
    """A writer process: the harness's sample app at ``rate`` business transactions per second."""
    sessions = max(1, math.ceil(rate / WRITER_RATE_PER_SESSION))
    load = Load(dsn, schema, topic, rate=rate, writers=sessions, keys=KEYS, seconds=seconds).start()
    while load.alive():
        written.value = load.count
        time.sleep(0.1)
    written.value = load.count
    if out_path is not None:
        Path(out_path).write_text(json.dumps([(w.event_id, w.at) for w in load.committed]))


WRITER_RATE_PER_PROCESS = 1500  # business transactions/s one writer process sustains comfortably
# ... and one session: a session's transactions run one after another, each waiting on its round
# trips and its commit's WAL flush. With one session a process, the snapshot scenario wrote
# 1,550/s of the 2,000 asked (WAL capture, a snapshot held or not), the steady one 700-750/s of
# 1,000: the rate asked was not the rate run. With a session per 400/s it wrote 2,000/s. The
# sessions of a process share its writes (each key on one session).
WRITER_RATE_PER_SESSION = 400


class Writers:
    """Writer processes committing ``rate`` business transactions/s in all (the GIL stays theirs)."""

    def __init__(self, ws: Workspace, rate: float, seconds: float, record: bool) -> None:
        ctx = mp.get_context("spawn")
        self.n = max(1, -(-int(rate) // WRITER_RATE_PER_PROCESS))
        self.counts = [ctx.Value("q", 0) for _ in range(self.n)]
        self.tmp = tempfile.TemporaryDirectory()
        self.paths = [str(Path(self.tmp.name) / f"w{i}.json") if record else None for i in range(self.n)]
        self.procs = [
            ctx.Process(
                target=_writer_proc,
                daemon=True,
                args=(ws.dsn, ws.schema, ws.topic, rate / self.n, seconds, count, path),
            )
            for path, count in zip(self.paths, self.counts, strict=True)
        ]

    @property
    def written(self) -> int:
        return sum(int(c.value) for c in self.counts)

    def start(self) -> None:
        for p in self.procs:
            p.start()

    def alive(self) -> bool:
        return any(p.is_alive() for p in self.procs)

    def join(self) -> dict[str, float]:
        for p in self.procs:
            p.join()
        commits: dict[str, float] = {}
        for path in self.paths:
            if path is not None and Path(path).exists():
                pairs: list[tuple[str, float]] = json.loads(Path(path).read_text())
                commits.update(pairs)
        self.tmp.cleanup()
        return commits


class SnapshotHolder:
    """Another session holding a snapshot: a REPEATABLE READ transaction that has read something
    keeps it (and the server's xmin horizon) until it ends, so vacuum cannot remove what is
    deleted meanwhile. Held for ``seconds``, or (None) until :meth:`release`."""

    def __init__(self, dsn: str, schema: str, seconds: float | None = None) -> None:
        self.dsn, self.schema, self.seconds = dsn, schema, seconds
        self.holding = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._hold, name="snapshot-holder", daemon=True)

    def start(self, wait: float = 10.0) -> None:
        """Take the snapshot (waits up to ``wait`` s for it to be held)."""
        self._thread.start()
        self.holding.wait(wait)

    def release(self) -> None:
        self._release.set()
        if self._thread.is_alive():
            self._thread.join(10)

    def _hold(self) -> None:
        with psycopg.connect(self.dsn) as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            conn.execute(query("harness_count_orders", self.schema))
            self.holding.set()
            self._release.wait(self.seconds)
            conn.rollback()


def wal_capable(dsn: str) -> bool:
    """Can this server run WAL capture (wal_level = logical, PostgreSQL 14+)?"""
    with psycopg.connect(dsn) as conn:
        level = conn.execute(query("wal_level", "public")).fetchone()
    return bool(level and level[0] == "logical" and int(level[1]) >= capture.MIN_SERVER)
