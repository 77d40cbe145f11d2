"""Helpers for integration tests: run a relay, read a topic, poll for a condition."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from outbox.relay.relay import Relay, RelayConfig
from outbox.sinks.base import Sink
from outbox.sinks.kafka import KafkaSink
from outbox.store.outboxes import Outbox


def wait_for(
    condition: Callable[[], Any], timeout: float = 30.0, interval: float = 0.05, what: str = ""
) -> Any:
    """Poll ``condition`` until it returns a truthy value; fail after ``timeout`` seconds.

    A condition that cannot reach PostgreSQL this time (``psycopg.OperationalError``) is polled
    again: beside the loaded suite on a machine at half its pace, a test's own connection once
    took over its 3 s connect timeout while the relays it watched were fine. The last such error
    is given with the timeout."""
    deadline = time.monotonic() + timeout
    error: psycopg.OperationalError | None = None
    while True:
        try:
            value = condition()
        except psycopg.OperationalError as exc:
            error, value = exc, None
        if value:
            return value
        if time.monotonic() > deadline:
            last = f" (last: {type(error).__name__}: {error})" if error is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what or condition}{last}")
        time.sleep(interval)


_polling = threading.local()
T = TypeVar("T")


def polled(dsn: str, query: Any, params: Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    """The rows of a read-only ``query`` on a session this thread keeps per DSN: tests poll
    (wait_for) at 20 calls a second, and a new session for each call cost 5.6 ms of CPU against
    0.3 ms on a kept one, a twentieth of the suite's CPU on two cores. A kept session that was
    dropped (a server restarted, a database dropped, a backend terminated) is opened again once;
    a second failure is raised (wait_for polls again)."""
    return kept(dsn, lambda conn: conn.execute(query, params).fetchall())


def kept(dsn: str, use: Callable[[psycopg.Connection[Any]], T]) -> T:
    """``use`` run on the autocommit session this thread keeps for ``dsn`` (as :func:`polled`):
    the fixtures make and drop a schema a test on it, two new sessions a test otherwise. A kept
    session that was dropped meanwhile is opened again once; ``use`` must be safe to run again
    after a session that failed (a migrate is: it commits each step)."""
    sessions: dict[str, psycopg.Connection[Any]] = _polling.__dict__.setdefault("sessions", {})
    for attempt in (1, 2):
        conn = sessions.get(dsn)
        if conn is None or conn.closed:
            conn = sessions[dsn] = psycopg.connect(dsn, autocommit=True, application_name="outbox-tests")
        try:
            return use(conn)
        except psycopg.OperationalError:
            sessions.pop(dsn, None)
            with contextlib.suppress(Exception):
                conn.close()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def count(dsn: str, schema: str, table: str, where: str = "true") -> int:
    rows = polled(
        dsn,
        sql.SQL("SELECT count(*) FROM {}.{} WHERE " + where).format(
            sql.Identifier(schema), sql.Identifier(table)
        ),
    )
    return int(rows[0][0])


@dataclass
class Message:
    key: bytes | None
    value: bytes
    headers: dict[str, bytes]
    partition: int
    offset: int

    @property
    def event_id(self) -> str:
        return self.headers["event-id"].decode()


def read_topic(bootstrap: str, topic: str, expected: int, timeout: float = 30.0) -> list[Message]:
    """Every message of ``topic`` from the beginning, once ``expected`` have arrived.

    Uses assign() rather than a consumer group: no rebalance wait. Waits a
    moment past ``expected`` so that extra (duplicate) messages are seen too.
    """
    admin = AdminClient({"bootstrap.servers": bootstrap})
    deadline = time.monotonic() + timeout

    def partitions() -> list[int]:
        md = admin.list_topics(topic, timeout=5)
        t = md.topics.get(topic)
        if t is None or t.error is not None or not t.partitions:
            return []
        return sorted(t.partitions)

    parts = wait_for(partitions, timeout=timeout, what=f"topic {topic}") if expected else partitions()
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"reader-{topic}",
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
        }
    )
    consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in parts])
    out: list[Message] = []
    seen: set[tuple[int, int]] = set()
    quiet_until: float | None = None
    try:
        while time.monotonic() < deadline:
            msg = consumer.poll(0.2)
            if msg is None:
                if len(out) >= expected:
                    quiet_until = quiet_until or time.monotonic() + 0.5
                    if time.monotonic() > quiet_until:
                        break
                continue
            if msg.error():
                continue
            # A message read twice at the same coordinates is one message (librdkafka fetches
            # again from the start after an offset reset); a duplicate has an offset of its own.
            if (msg.partition(), msg.offset()) in seen:
                continue
            seen.add((msg.partition(), msg.offset()))
            out.append(
                Message(
                    msg.key(),
                    msg.value(),
                    {k: v for k, v in (msg.headers() or [])},
                    msg.partition(),
                    msg.offset(),
                )
            )
    finally:
        consumer.close()
    if len(out) < expected:
        raise AssertionError(f"read {len(out)} messages from {topic}, expected {expected}")
    return out


@contextlib.contextmanager
def running_relay(
    config: RelayConfig,
    sink_factory: Callable[[], Sink] | None = None,
    bootstrap: str = "",
    outboxes: Sequence[Outbox] | None = None,
) -> Iterator[Relay]:
    """A relay running in a thread for the duration of the block, then stopped (``outboxes``:
    the outboxes of one database it serves; by default config's dsn and schema)."""
    factory = sink_factory or (lambda: KafkaSink(bootstrap, delivery_timeout=config.delivery_timeout))
    relay = Relay(config, factory, outboxes)
    errors: list[BaseException] = []

    def target() -> None:
        try:
            relay.run()
        except BaseException as exc:  # surfaced in the test below
            errors.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        relay.stop()
        thread.join(config.grace + 10)
        assert not thread.is_alive(), "relay did not stop"
    if errors:
        raise errors[0]


class ModuleProcess:
    """``python -m MODULE ARGS`` as a real process (for SIGKILL/SIGTERM tests), without the
    caller's OUTBOX_* variables, with ``tests`` importable; output to a temp file."""

    def __init__(self, module: str, *args: str, env: dict[str, str] | None = None) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        # tests.sinks must be importable for --sink tests.sinks:...
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        base["PYTHONPATH"] = os.pathsep.join(filter(None, [root, base.get("PYTHONPATH")]))
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            env={**base, **(env or {})},
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

    def output(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then wait; returns the exit code."""
        self.proc.terminate()
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()

    def __enter__(self) -> ModuleProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RelayProcess(ModuleProcess):
    """``outbox relay`` as a real process."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        bootstrap: str | None,
        *extra: str,
        env: dict[str, str] | None = None,
        module: str = "outbox",
    ) -> None:
        """``bootstrap`` None: no --kafka-bootstrap (routes come in ``extra``). ``module``: what
        ``python -m`` runs (tests.flaky_relay injects sink failures)."""
        kafka = ("--kafka-bootstrap", bootstrap) if bootstrap else ()
        super().__init__(module, "relay", "--dsn", dsn, "--schema", schema, *kafka, *extra, env=env)

    def __enter__(self) -> RelayProcess:
        return self

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM once the relay has started, then wait; returns the exit code. A SIGTERM
        before its handlers are installed ends it with -15 and no output: beside a loaded
        suite a relay can still be importing when another relay has drained a short test's
        events (seen in CI: the per-key order test on NATS)."""
        deadline = time.monotonic() + 60
        while self.proc.poll() is None and " started" not in self.output() and time.monotonic() < deadline:
            time.sleep(0.1)
        return super().stop(timeout)


# Relay options for tests of ownership and ordering: short leases, quick retries.
FAST = (
    "--ownership-lease", "3", "--lease", "4", "--delivery-timeout", "2",
    "--retry-base", "0.05", "--retry-cap", "0.3", "--max-attempts", "100",
    "--poll-interval", "0.2", "--batch-size", "200",
)  # fmt: skip


def first_occurrences(messages: list[Message]) -> list[Message]:
    seen: set[str] = set()
    out = []
    for m in messages:
        if m.event_id not in seen:
            seen.add(m.event_id)
            out.append(m)
    return out


def assert_per_key_order(messages: list[Message]) -> None:
    """After keeping the first occurrence of each event-id, every key's seq strictly increases.

    Messages come partition by partition in offset order; one key lives in one
    Kafka partition, so per-key order is the order read.
    """
    import json

    last: dict[str, int] = {}
    for m in first_occurrences(messages):
        body = json.loads(m.value)
        k, seq = body["k"], body["seq"]
        assert seq > last.get(k, -1), f"key {k}: seq {seq} after {last.get(k)}"
        last[k] = seq


def owners(dsn: str, schema: str) -> dict[int, str | None]:
    """partition -> owner id of every partition whose lease is valid (its owner's membership)."""
    rows = polled(
        dsn,
        sql.SQL(
            "SELECT p.partition, p.owner::text FROM {}.partitions AS p "
            "JOIN outbox_fleet.relays AS f ON f.id = p.owner AND f.expires_at > now() ORDER BY 1"
        ).format(sql.Identifier(schema)),
    )
    return {p: o for p, o in rows}


def http_get(port: int, path: str) -> tuple[int, str]:
    """(status, body) of GET ``path`` on 127.0.0.1:``port``; an HTTP error status is returned, not raised."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def write_rounds(
    dsn: str, schema: str, topic: str, keys: int, rounds: int, first: int = 0, key_prefix: str = ""
) -> None:
    """``rounds`` transactions of one event per key (payload {"k", "seq"}): commit order is seq
    order for every key, as :func:`assert_per_key_order` checks. ``key_prefix``: keys of this
    outbox's own (several outboxes writing to one topic)."""
    import outbox

    with psycopg.connect(dsn) as conn:
        for seq in range(first, first + rounds):
            outbox.enqueue_many(
                conn,
                [
                    {
                        "topic": topic,
                        "key": f"{key_prefix}k{k}",
                        "payload": {"k": f"{key_prefix}k{k}", "seq": seq},
                    }
                    for k in range(keys)
                ],
                schema=schema,
            )
            conn.commit()


def catalog(conn: psycopg.Connection[Any], schema: str) -> dict[str, list[tuple[Any, ...]]]:
    """What a schema holds (columns, indexes, functions, triggers, options, recorded versions),
    with the schema's name replaced by ``S``: equal for schemas migrated the same way."""
    q = {
        "columns": "SELECT table_name, column_name, data_type, is_nullable, column_default "
        "FROM information_schema.columns WHERE table_schema = %s ORDER BY 1, 2",
        "indexes": "SELECT tablename, indexname, replace(indexdef, %s, 'S') FROM pg_indexes "
        "WHERE schemaname = %s ORDER BY 1, 2",
        "functions": "SELECT p.proname, replace(p.prosrc, %s, 'S') FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace WHERE n.nspname = %s ORDER BY 1",
        "triggers": "SELECT event_object_table, trigger_name, action_timing, event_manipulation "
        "FROM information_schema.triggers WHERE trigger_schema = %s ORDER BY 1, 2",
        "options": "SELECT c.relname, c.reloptions, c.relkind FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE n.nspname = %s ORDER BY 1",
        "versions": "",
    }
    out: dict[str, list[tuple[Any, ...]]] = {}
    for name, text in q.items():
        if name == "versions":
            out[name] = conn.execute(
                sql.SQL("SELECT version, name, checksum FROM {}.schema_migrations ORDER BY 1").format(
                    sql.Identifier(schema)
                )
            ).fetchall()
        elif name in ("indexes", "functions"):
            out[name] = [
                tuple(str(v).replace(schema, "S") for v in r)
                for r in conn.execute(text, (schema, schema)).fetchall()
            ]
        else:
            out[name] = [
                tuple(str(v).replace(schema, "S") for v in r)
                for r in conn.execute(text, (schema,)).fetchall()
            ]
    return out


def waiting_on_a_lock(dsn: str, schema: str) -> bool:
    """Is a session waiting for a lock in a statement that names ``schema``'s archive?"""
    rows = polled(
        dsn,
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE %s",
        (f'%"{schema}".delivered%',),
    )
    return int(rows[0][0]) > 0


@contextlib.contextmanager
def login_in(dsn: str, schema: str, group: str) -> Iterator[str]:
    """A login role in the outbox's ``group`` role (``writer``, ``relay`` or ``console``), the
    three granted on ``schema`` under names of this call's own: a DSN to it. Roles are
    cluster-wide: all four are dropped after."""
    from outbox.store.migrate import Roles, grant_roles

    tag = uuid.uuid4().hex[:8]
    roles = Roles(writer=f"w_{tag}", relay=f"r_{tag}", console=f"c_{tag}")
    login = f"{group}_{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        grant_roles(conn, schema, roles)
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                sql.Identifier(login), sql.Identifier(getattr(roles, group))
            )
        )
    try:
        yield make_conninfo(dsn, user=login)
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            for role in (login, roles.writer, roles.relay, roles.console):
                conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def recorded_slot(dsn: str, schema: str) -> str:
    """The replication slot an outbox in WAL capture reads, as its capture table records it."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL("SELECT slot FROM {}.capture").format(sql.Identifier(schema))).fetchone()
    assert row is not None and row[0] is not None, f"{schema} has no slot"
    return str(row[0])
