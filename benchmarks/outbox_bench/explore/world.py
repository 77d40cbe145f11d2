"""One schedule, played: the relays, the writer, the faults and the operator, then what happened.

The relays are the ``outbox relay`` command, one process each, with the scripted sink; the
writer writes through :func:`outbox.write.writer.enqueue_many`, as an application does; the operator
acts through :func:`outbox.operate.dead.act`, as ``outbox dead redrive``/``skip`` do. Faults are real:
SIGKILL, SIGSTOP, ``pg_terminate_backend`` and a restart of the PostgreSQL of its own.
What happened is gathered into a :class:`Record` for the checker: nothing in it comes from the
relay's own account of itself but its logs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

from outbox import capture
from outbox.harness.embedded import EmbeddedPostgres, free_port
from outbox.operate import dead
from outbox.store.dsn import for_child
from outbox.store.migrate import migrate
from outbox.write.writer import enqueue_many
from outbox_bench.explore.schedule import POLL_INTERVAL, Fault, Schedule
from outbox_bench.explore.sink import ENV_JOURNAL, ENV_RELAY, ENV_SCHEDULE, ENV_T0, TWIN_TOPIC
from outbox_bench.faults.relays import stop_processes
from outbox_bench.queries import query

TOPIC = "orders.placed"
SINK = "outbox_bench.explore.sink:scripted"
READY_TIMEOUT = 30.0  # seconds for a relay to answer /readyz
DRAIN_TIMEOUT = 40.0  # seconds past the schedule's end for every event to settle, while it moves
DRAIN_STILL = 15.0  # seconds without an event settling, past DRAIN_TIMEOUT, before it counts as stuck
DRAIN_MOST = 180.0  # seconds past the schedule's end at most, however slowly it moves
STOP_TIMEOUT = 15.0  # seconds for a relay to stop on SIGTERM


@dataclass
class Record:
    """What a run did, for the checker: the writer's, the operator's and the faults' own
    accounts, the sink's journal, the tables at the end and the relays' logs."""

    schedule: Schedule
    committed: dict[int, str] = field(default_factory=dict)  # n -> key, in commit order
    rolled_back: set[int] = field(default_factory=set)
    uncertain: dict[int, str] = field(default_factory=dict)  # commit interrupted: either way
    faults: list[tuple[str, int, float, float]] = field(default_factory=list)  # kind, relay, from, to
    actions: list[tuple[str, float, list[int]]] = field(default_factory=list)  # kind, at, n's
    journal: list[dict[str, Any]] = field(default_factory=list)
    archived: list[int] = field(default_factory=list)  # n per archive row
    dead: dict[int, tuple[str, bool]] = field(default_factory=dict)  # n -> (error, parked)
    pending: list[int] = field(default_factory=list)
    # The twin outboxes': n per archive row, and n's pending, per twin (schedule.twins)
    twins_archived: list[list[int]] = field(default_factory=list)
    twins_pending: list[list[int]] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)
    drained: bool = False
    t0: float = 0.0


def _n_of(payload: bytes) -> int:
    return int(json.loads(payload)["n"])


class World:
    """Plays schedules on one PostgreSQL (of its own: a schedule may restart it)."""

    def __init__(self, server: EmbeddedPostgres, workdir: Path, sink: str = SINK) -> None:
        self.server = server
        self.workdir = workdir
        self.sink = sink  # the relays' --sink: the scripted sink, or a test's wrapper of it
        self._runs = 0

    def play(self, schedule: Schedule, progress: Any = None) -> Record:
        self._runs += 1
        run = Run(
            self.server, schedule, self.workdir / f"run-{schedule.seed}-{self._runs}", progress, self.sink
        )
        return run.play()


class Run:
    def __init__(
        self, server: EmbeddedPostgres, schedule: Schedule, where: Path, progress: Any, sink: str
    ) -> None:
        self.server = server
        self.sink = sink
        self.s = schedule
        self.dir = where
        shutil.rmtree(where, ignore_errors=True)  # a run of an earlier search: its journal is not this one's
        self.dir.mkdir(parents=True)
        (self.dir / "journal").mkdir(exist_ok=True)
        self.schema = f"explore_{schedule.seed % 10**9}_{os.getpid()}_{int(time.time() * 1000) % 10**6}"
        self.twins = [f"{self.schema}_t{i}" for i in range(schedule.twins)]
        self.record = Record(schedule)
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.ports: dict[int, int] = {}
        self.starts = 0
        self.down: set[int] = set()  # killed, not started again yet
        self.progress = progress
        self.lock = threading.Lock()  # the operator and the faults, against the final stop

    # -- the run ---------------------------------------------------------------------

    def play(self) -> Record:
        s = self.s
        with psycopg.connect(self.server.dsn, autocommit=True) as conn:
            migrate(conn, self.schema)
            if s.capture == "wal":
                capture.switch(conn, self.schema, "wal")
            for twin in self.twins:
                migrate(conn, twin)
        (self.dir / "schedule.json").write_text(s.to_json())
        try:
            for i in range(s.relays):
                self._start(i)
            for i in range(s.relays):
                self._wait_ready(i)
            self.record.t0 = t0 = time.time()
            (self.dir / "t0").write_text(repr(t0))
            threads = [
                threading.Thread(target=self._write, name="explore-writer", daemon=True),
                threading.Thread(target=self._faults, name="explore-faults", daemon=True),
                threading.Thread(target=self._operate, name="explore-operator", daemon=True),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self.record.drained = self._drain(
                t0 + s.ends + DRAIN_TIMEOUT + 3 * s.lease, t0 + s.ends + DRAIN_MOST
            )
        finally:
            self._stop_all()
        self._gather()
        self._keep()
        return self.record

    def _keep(self) -> None:
        """The writer's, the operator's and the faults' accounts, next to the journal and the logs:
        what a failure is looked into with."""
        r = self.record
        kept = {
            "t0": r.t0, "drained": r.drained, "committed": r.committed, "rolled_back": sorted(r.rolled_back),
            "uncertain": r.uncertain, "faults": r.faults, "actions": r.actions, "archived": r.archived,
            "dead": r.dead, "pending": r.pending,
        }  # fmt: skip
        (self.dir / "record.json").write_text(json.dumps(kept, indent=1))

    def _say(self, line: str) -> None:
        if self.progress is not None:
            self.progress(line)

    # -- relays -------------------------------------------------------------------------

    def _start(self, i: int) -> None:
        s = self.s
        self.starts += 1
        log = self.dir / f"relay{i}-{self.starts}.log"
        self.record.logs.append(log)
        self.ports[i] = port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env |= {
            ENV_SCHEDULE: str(self.dir / "schedule.json"),
            ENV_JOURNAL: str(self.dir / "journal"),
            ENV_T0: str(self.dir / "t0"),
            ENV_RELAY: str(i),
        }
        dsn, secret = for_child(
            psycopg.conninfo.make_conninfo(self.server.dsn, application_name=f"explore-relay-{i}")
        )
        env |= secret  # the password in the environment, not on the command line (ps)
        with open(log, "wb") as out:
            self.procs[i] = subprocess.Popen(
                [
                    sys.executable, "-m", "outbox", "relay", *self._outboxes(dsn), "--sink", self.sink,
                    "--kafka-bootstrap", "127.0.0.1:9",
                    "--name", f"explore-{i}", "--ordering", s.ordering, "--on-dead", s.on_dead,
                    "--batch-size", str(s.batch_size), "--batches-in-flight", str(s.in_flight),
                    "--lease", str(s.lease), "--delivery-timeout", str(s.delivery_timeout),
                    "--ownership-lease", str(s.ownership_lease), "--net-timeout", "2",
                    "--retry-base", str(s.retry_base), "--retry-cap", str(s.retry_cap),
                    "--max-attempts", str(s.max_attempts), "--poll-interval", str(POLL_INTERVAL),
                    "--grace", "3",
                    "--metrics-port", str(port), "--log-format", "json", "--log-level", "info",
                ],
                env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def _outboxes(self, dsn: str) -> list[str]:
        """The relay's outboxes: the one checked, and the twins beside it (--outbox each)."""
        if not self.twins:
            return ["--dsn", dsn, "--schema", self.schema]
        spec = [f"checked={dsn}#{self.schema}"] + [f"twin{i}={dsn}#{t}" for i, t in enumerate(self.twins)]
        # Two twins: shared transactions of two outboxes, so that the third's claim is sent ahead
        # while they are sent (outbox.pipelined); all three would share one, with nothing left.
        grouped = ["--shared-outboxes", "2"] if len(self.twins) >= 2 else []
        return [arg for each in spec for arg in ("--outbox", each)] + grouped

    def _wait_ready(self, i: int) -> None:
        import urllib.request

        deadline = time.monotonic() + READY_TIMEOUT
        while time.monotonic() < deadline:
            if self.procs[i].poll() is not None:
                break
            url = f"http://127.0.0.1:{self.ports[i]}/readyz"
            with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
            time.sleep(0.1)
        tail = self.record.logs[-1].read_text(errors="replace")[-1500:]
        raise RuntimeError(f"relay {i} did not become ready; its log ends:\n{tail}")

    def _stop_all(self) -> None:
        stop_processes(list(self.procs.values()), STOP_TIMEOUT)

    # -- the writer -----------------------------------------------------------------------

    def _write(self) -> None:
        s = self.s
        rng = random.Random(f"{s.seed}/writer")
        weights = [1.0 / (k + 1) ** s.skew for k in range(s.keys)]
        keys = [f"customer-{k}" for k in range(s.keys)]
        n = 0
        t0 = self.record.t0
        conn: psycopg.Connection[Any] | None = None
        while n < s.events:
            at = t0 + s.write_for * n / s.events
            time.sleep(max(0.0, at - time.time()))
            size = min(rng.randint(1, s.txn_size), s.events - n)
            batch = [(n + j, rng.choices(keys, weights)[0]) for j in range(size)]
            n += size
            rollback = rng.random() < s.rollback
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(
                        self.server.dsn, application_name="explore-writer", connect_timeout=3
                    )
                enqueue_many(conn, [self._event(m, key) for m, key in batch], schema=self.schema)
                for twin in self.twins:  # due at the same steps: their batches share transactions
                    twinned = [{"topic": TWIN_TOPIC, "key": key, "payload": {"n": m}} for m, key in batch]
                    enqueue_many(conn, twinned, schema=twin)
                if rollback:
                    conn.rollback()
                    self.record.rolled_back.update(m for m, _ in batch)
                    continue
                conn.commit()
            except psycopg.OperationalError:
                # Lost in the middle (a restart): it committed or it did not.
                self.record.uncertain.update(batch)
                with contextlib.suppress(psycopg.Error):
                    if conn is not None:
                        conn.close()
                conn = None
                continue
            self.record.committed.update(batch)
        if conn is not None:
            conn.close()

    def _event(self, n: int, key: str) -> dict[str, Any]:
        trace = f"{random.Random(n).getrandbits(128):032x}"
        return {
            "topic": TOPIC,
            "key": key,
            "payload": {
                "n": n,
                "customer": key,
                "order": {"lines": [{"sku": f"sku-{n % 97}", "qty": 1 + n % 3}]},
            },
            "headers": {"traceparent": f"00-{trace}-{trace[:16]}-01", "source": "explore"},
        }

    # -- faults and the operator ------------------------------------------------------

    def _faults(self) -> None:
        timers: list[threading.Timer] = []
        for f in self.s.faults:
            time.sleep(max(0.0, self.record.t0 + f.at - time.time()))
            self._fault(f, timers)
        for t in timers:
            t.join()

    def _fault(self, f: Fault, timers: list[threading.Timer]) -> None:
        start = time.time()
        self._say(f"{start - self.record.t0:6.2f} s  {f.kind} {f.relay if f.relay >= 0 else ''}")
        with self.lock:
            p = self.procs.get(f.relay)
            if f.kind == "kill" and p is not None and f.relay not in self.down:
                p.kill()
                p.wait()
                self.down.add(f.relay)
                timers.append(self._later(f.lasts, lambda: self._back(f.relay)))
            elif f.kind == "stop" and p is not None and p.poll() is None:
                p.send_signal(signal.SIGSTOP)
                timers.append(self._later(f.lasts, lambda: self._cont(p)))
            elif f.kind == "terminate":
                with (
                    contextlib.suppress(psycopg.Error),
                    psycopg.connect(self.server.dsn, autocommit=True) as conn,
                ):
                    conn.execute(
                        query("explore_terminate", self.schema), {"name": f"explore-relay-{f.relay}"}
                    )
            elif f.kind == "restart":
                self.server.restart()
        self.record.faults.append((f.kind, f.relay, start, time.time() + f.lasts))

    def _later(self, delay: float, then: Any) -> threading.Timer:
        t = threading.Timer(delay, then)
        t.start()
        return t

    def _back(self, i: int) -> None:
        with self.lock:
            self.down.discard(i)
            self._start(i)

    def _cont(self, p: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(ProcessLookupError):
            p.send_signal(signal.SIGCONT)

    def _operate(self) -> None:
        for a in self.s.actions:
            time.sleep(max(0.0, self.record.t0 + a.at - time.time()))
            for _ in range(20):  # through a restart of the server
                try:
                    self._act(a.kind)
                    break
                except psycopg.OperationalError:
                    time.sleep(0.5)

    def _act(self, kind: str) -> None:
        with self._connect("explore-operator") as conn:
            chosen = {"parked_only": kind == "skip"}
            rows = conn.execute(query("explore_dead_letters", self.schema), chosen).fetchall()
            ids = [r[0] for r in rows]
            dead.act(conn, self.schema, kind, ids, {}, via="cli", actor="explore")
            at = time.time()
        self.record.actions.append((kind, at, [_n_of(r[1]) for r in rows]))
        self._say(f"{at - self.record.t0:6.2f} s  operator: {kind} {len(ids)}")

    # -- the end ---------------------------------------------------------------------------

    def _accounted(self) -> tuple[set[int], set[int]]:
        """(n's archived or dead-lettered, n's pending); a twin's pending count as pending and not
        done (they are delivered at once: pending only while a relay has yet to archive them)."""
        with self._connect("explore-check") as conn:
            done = {_n_of(r[0]) for r in conn.execute(query("explore_archived", self.schema))}
            done |= {_n_of(r[0]) for r in conn.execute(query("explore_dead", self.schema))}
            pending = {_n_of(r[0]) for r in conn.execute(query("explore_pending", self.schema))}
            for twin in self.twins:
                twin_pending = {_n_of(r[0]) for r in conn.execute(query("explore_pending", twin))}
                pending |= twin_pending
                done -= twin_pending
        return done, pending

    def _drain(self, deadline: float, most: float) -> bool:
        """Until every committed event is archived or dead-lettered, or waits parked (pending,
        its key behind a parked dead letter). Past ``deadline``, only while events still settle
        (a hot key failing one send in ten takes its time), up to ``most``."""
        settled, moved = -1, time.time()
        while time.time() < most:
            time.sleep(0.3)
            try:
                done, pending = self._accounted()
            except psycopg.OperationalError:
                continue
            wanted = set(self.record.committed)
            if wanted <= done | pending and not (pending - done) - self._parked_pending():
                return True
            if len(done) != settled:
                settled, moved = len(done), time.time()
            if time.time() > deadline and time.time() - moved > DRAIN_STILL:
                return False
        return False

    def _parked_pending(self) -> set[int]:
        with self._connect("explore-check") as conn:
            return {_n_of(r[0]) for r in conn.execute(query("explore_parked", self.schema))}

    def _connect(self, name: str) -> psycopg.Connection[Any]:
        return psycopg.connect(self.server.dsn, application_name=name, connect_timeout=3)

    def _gather(self) -> None:
        rec = self.record
        for path in sorted((self.dir / "journal").glob("*.jsonl")):
            for line in path.read_text().splitlines():
                if line.strip():
                    rec.journal.append(json.loads(line))
        rec.journal.sort(key=lambda r: r["t"])
        q = self.schema
        for _ in range(20):
            try:
                with self._connect("explore-check") as conn:
                    rec.archived = [_n_of(r[0]) for r in conn.execute(query("explore_archived", q))]
                    rec.dead = {_n_of(r[0]): (r[1], r[2]) for r in conn.execute(query("explore_dead", q))}
                    rec.pending = [_n_of(r[0]) for r in conn.execute(query("explore_pending", q))]
                    rec.twins_archived = [
                        [_n_of(r[0]) for r in conn.execute(query("explore_archived", t))] for t in self.twins
                    ]
                    rec.twins_pending = [
                        [_n_of(r[0]) for r in conn.execute(query("explore_pending", t))] for t in self.twins
                    ]
                break
            except psycopg.OperationalError:
                time.sleep(0.5)
        with contextlib.suppress(psycopg.Error), psycopg.connect(self.server.dsn, autocommit=True) as conn:
            if self.s.capture == "wal":
                conn.execute(query("explore_drop_slot", q), {"slot": capture.state(conn, q).slot})
            for schema in [q, *self.twins]:
                conn.execute(query("harness_drop_schema", schema))
