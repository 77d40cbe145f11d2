"""The fuzzer's world: two outboxes (table and WAL capture) served by one real relay process, a
writer role and a stranger role, Kafka, and the scripted webhook receiver. ``play`` writes one
round of inputs through their doors, then waits until every event of the round has settled.

Nothing here decides whether the relay did right: that is :mod:`tests.fuzz.checker`'s, from what
the world recorded (the inputs, the ids written, the errors refused with) and what the tables,
the broker, the receiver and the relay's log hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox import capture
from outbox.store.migrate import Roles, grant_roles, migrate
from tests.fuzz.doors import HOOK, POOL, XF, Input
from tests.fuzz.receiver import ScriptedReceiver

ROOT = Path(__file__).resolve().parents[2]
SETTLE = 45.0  # seconds a round may take to settle before the checker calls it stalled
RELAY_OPTIONS = (
    "--poll-interval", "0.05", "--retry-base", "0.02", "--retry-cap", "0.1", "--max-attempts", "3",
    "--delivery-timeout", "2", "--lease", "10", "--log-format", "text", "--log-level", "info",
    "--transform", f"{XF.split('.')[0]}.*=tests.fuzz.transform:directed",
)  # fmt: skip


@dataclass
class Round:
    number: int
    inputs: list[Input]
    markers: dict[str, str] = field(default_factory=dict)  # outbox -> the marker event's id
    dead_seq: dict[str, int] = field(default_factory=dict)  # outbox -> max(seq) of dead letters before
    settled: bool = False
    took: float = 0.0


class World:
    def __init__(self, dsn: str, kafka: str, workdir: Path, *, wal: bool = True) -> None:
        self.dsn, self.kafka, self.workdir = dsn, kafka, workdir
        tag = uuid.uuid4().hex[:8]
        self.tag = tag
        self.schemas = {"table": f"fz_t_{tag}"} | ({"wal": f"fz_w_{tag}"} if wal else {})
        self.roles = Roles(writer=f"fzw_{tag}", relay=f"fzr_{tag}", console=f"fzc_{tag}")
        self.writer_login, self.stranger = f"fzwl_{tag}", f"fzs_{tag}"
        with psycopg.connect(dsn, autocommit=True) as conn:
            for outbox_name, schema in self.schemas.items():
                migrate(conn, schema)
                if outbox_name == "wal":
                    capture.switch(conn, schema, "wal")
                grant_roles(conn, schema, self.roles)
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE {}").format(
                sql.Identifier(self.writer_login), sql.Identifier(self.roles.writer)))  # fmt: skip
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(self.stranger)))
        self.writer_dsn = make_conninfo(dsn, user=self.writer_login)
        self.stranger_dsn = make_conninfo(dsn, user=self.stranger)
        self.receiver = ScriptedReceiver()
        self.log_path = workdir / "relay.log"
        self._log = open(self.log_path, "wb")
        self.log_read = 0  # bytes of the log the checker has looked at
        outboxes = [a for name, s in self.schemas.items() for a in ("--outbox", f"{name}={dsn}#{s}")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        self.relay = subprocess.Popen(
            [
                sys.executable, "-m", "outbox", "relay", *outboxes, "--kafka-bootstrap", kafka,
                "--route", f"{HOOK}=http://127.0.0.1:{self.receiver.port}/hooks/{{topic}}", *RELAY_OPTIONS,
            ],
            env=env, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        self.rounds: list[Round] = []
        self._doors = {
            "api": self._api, "api_many": self._api, "api_async": self._async, "sql": self._sql,
            "emit": self._emit, "stranger": self._stranger, "reply": self._reply, "transform": self._transform,
        }  # fmt: skip
        deadline = time.monotonic() + 60
        while b" started" not in self.log_path.read_bytes() and time.monotonic() < deadline:
            if self.relay.poll() is not None:
                break
            time.sleep(0.05)

    # -- a round ---------------------------------------------------------------------------------

    def play(self, inputs: list[Input]) -> Round:
        r = Round(len(self.rounds) + 1, inputs)
        self.rounds.append(r)
        started = time.monotonic()
        r.dead_seq = {name: self._max_seq(schema) for name, schema in self.schemas.items()}
        for inp in inputs:
            if inp.outbox not in self.schemas:
                inp.outbox = "table"
            if inp.good:
                _through_door(inp, f"good-{self.tag}-{r.number}-{inp.fields['key']}")
            if inp.door in ("emit", "stranger") and "wal" not in self.schemas:
                inp.refused = "no WAL capture on this server"
                continue
            try:
                self._doors[inp.door](inp)
            except _Refused as exc:
                inp.refused = exc.args[0]
        with psycopg.connect(self.dsn) as conn:  # last, in each outbox: read after the round
            for name, schema in self.schemas.items():
                r.markers[name] = str(
                    outbox.enqueue(conn, POOL[0], f"marker {r.number}".encode(), schema=schema)
                )
        r.settled = self._settle(r)
        r.took = time.monotonic() - started
        return r

    def _settle(self, r: Round) -> bool:
        deadline = time.monotonic() + SETTLE
        while time.monotonic() < deadline:
            if self.relay.poll() is not None:
                return False
            # A candidate (an id a WAL message names) may never be seen (a message that is no
            # event is dead-lettered under an id of its own); once seen, it must settle too.
            candidates = {c for inp in r.inputs for c in inp.candidates}
            states = self.states(r, candidates=True)
            if all(
                state in FINAL or (state == "unseen" and i in candidates) for (_, i), state in states.items()
            ):
                return True
            time.sleep(0.05)
        return False

    def ids_of(self, r: Round, *, candidates: bool = False) -> dict[str, list[str]]:
        """Each outbox's event ids the round wrote, markers included; with ``candidates``, the
        ids the round's WAL messages name too (a message that is no event is dead-lettered under
        an id of its own, so a round settles without them: the marker after them is the proof)."""
        out: dict[str, list[str]] = {name: [r.markers[name]] for name in self.schemas}
        for inp in r.inputs:
            if inp.outbox in out:
                out[inp.outbox].extend(inp.ids)
                if candidates:
                    out[inp.outbox].extend(inp.candidates)
        return out

    def states(self, r: Round, *, candidates: bool = False) -> dict[tuple[str, str], str]:
        """(outbox, event id) -> delivered, dead, later (available later), parked (behind a parked
        dead letter of its key), behind (after a pending event of its key available later),
        pending (claimable now), or unseen (not in any table: a WAL message not handed on yet)."""
        out: dict[tuple[str, str], str] = {}
        with psycopg.connect(self.dsn) as conn:
            for name, ids in self.ids_of(r, candidates=candidates).items():
                rows = conn.execute(
                    sql.SQL(STATES).format(s=sql.Identifier(self.schemas[name])), {"ids": ids}
                ).fetchall()
                found = {e: state for e, state in rows}
                for event_id in ids:
                    out[(name, event_id)] = found.get(event_id, "unseen")
        return out

    def _max_seq(self, schema: str) -> int:
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                sql.SQL("SELECT coalesce(max(seq), 0) FROM {}.dead_letters").format(sql.Identifier(schema))
            ).fetchone()
        return int(row[0]) if row else 0

    # -- the doors -------------------------------------------------------------------------------

    def _api(self, inp: Input) -> None:
        schema = self.schemas[inp.outbox]
        with psycopg.connect(self.writer_dsn) as conn:
            try:
                if inp.door == "api_many":
                    ids = outbox.enqueue_many(conn, inp.fields["events"], schema=schema)
                else:
                    ids = [outbox.enqueue(conn, schema=schema, **inp.fields["events"][0])]
            except Exception as exc:
                conn.rollback()
                raise _Refused(f"{type(exc).__name__}: {exc}") from None
        inp.ids = [str(i) for i in ids]

    def _async(self, inp: Input) -> None:
        import asyncpg

        p = conninfo_to_dict(self.writer_dsn)

        async def write() -> str:
            conn = await asyncpg.connect(
                host=p.get("host"), port=int(p.get("port") or 5432), user=p.get("user"),
                database=p.get("dbname"), password=p.get("password"),
            )  # fmt: skip
            try:
                async with conn.transaction():
                    return str(
                        await outbox.enqueue_async(
                            conn, schema=self.schemas[inp.outbox], **inp.fields["events"][0]
                        )
                    )
            finally:
                await conn.close()

        try:
            inp.ids = [asyncio.run(write())]
        except Exception as exc:
            raise _Refused(f"{type(exc).__name__}: {exc}") from None

    def _sql(self, inp: Input) -> None:
        f = dict(inp.fields)
        for when in ("available_at", "expires_at"):
            if f[when] == "soon":
                f[when] = (datetime.now(timezone.utc) + timedelta(seconds=0.3)).isoformat()
        insert = sql.SQL(
            "INSERT INTO {}.events (event_id, topic, key, payload, headers, type, subject, available_at, expires_at) "
            "VALUES (%(event_id)s::uuid, %(topic)s, %(key)s, %(payload)s, %(headers)s::jsonb, %(type)s, "
            "%(subject)s, coalesce(%(available_at)s::timestamptz, now()), %(expires_at)s::timestamptz)"
        ).format(sql.Identifier(self.schemas[inp.outbox]))
        key = f["key"].encode("utf-8", "surrogatepass") if isinstance(f["key"], str) else f["key"]
        try:
            with psycopg.connect(self.writer_dsn) as conn:
                conn.execute(insert, {**f, "key": key})
        except (psycopg.Error, UnicodeError, ValueError) as exc:  # PostgreSQL (or the driver) refused
            raise _Refused(f"{type(exc).__name__}: {exc}") from None
        inp.ids = [f["event_id"]]

    def _emit(self, inp: Input) -> None:
        inp.contents = list(inp.fields["messages"])
        if inp.good:
            inp.ids = [inp.fields["id"]]
        for content in inp.contents:
            with contextlib.suppress(ValueError, IndexError, TypeError, UnicodeDecodeError):
                head = json.loads(content.split(b"\n", 1)[0])
                if isinstance(head, list) and head and isinstance(head[0], str):
                    with contextlib.suppress(ValueError):
                        inp.candidates.append(str(uuid.UUID(head[0])))
        statement = sql.SQL("SELECT {}.emit_events(%s::bytea[])").format(sql.Identifier(self.schemas["wal"]))
        try:
            with psycopg.connect(self.writer_dsn) as conn:
                conn.execute(statement, (inp.contents,))
        except psycopg.Error as exc:
            inp.candidates = []
            raise _Refused(f"{type(exc).__name__}: {exc}") from None

    def _stranger(self, inp: Input) -> None:
        inp.contents = [inp.fields["content"]]
        with psycopg.connect(self.stranger_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_logical_emit_message(%s, %s, %s::bytea)",
                (inp.fields["transactional"], capture.prefix_of(self.schemas["wal"]), inp.fields["content"]),
            )

    def _reply(self, inp: Input) -> None:
        event_id = uuid.uuid4()
        with self.receiver.lock:
            self.receiver.script[str(event_id)] = list(inp.fields["replies"])
        self._insert(inp, event_id, HOOK, inp.fields["payload"], inp.fields["key"])

    def _transform(self, inp: Input) -> None:
        payload = json.dumps(inp.fields["directive"], ensure_ascii=False).encode("utf-8", "surrogatepass")
        self._insert(inp, uuid.uuid4(), XF, payload, None)

    def _insert(self, inp: Input, event_id: uuid.UUID, topic: str, payload: bytes, key: Any) -> None:
        """An event with a chosen id, as the owner writes it (its fields are not what is fuzzed)."""
        if isinstance(key, str):
            key = key.encode("utf-8", "surrogatepass")
        schema = sql.Identifier(self.schemas[inp.outbox])
        try:
            with psycopg.connect(self.dsn) as conn:
                if inp.outbox == "wal":  # as the writer would: a message, through enqueue's encoder
                    from outbox.capture import wal_message
                    from outbox.events import EncodedEvent

                    message = wal_message.encode(EncodedEvent(event_id, topic, key, payload, {}, 0.0))
                    conn.execute(sql.SQL("SELECT {}.emit_events(%s::bytea[])").format(schema), ([message],))
                    # Unchecked (a key past the limit): an event of this id, or a dead letter of its own.
                    inp.contents, inp.candidates = [message], [str(event_id)]
                    return
                else:
                    conn.execute(
                        sql.SQL(
                            "INSERT INTO {}.events (event_id, topic, key, payload) VALUES (%s, %s, %s, %s)"
                        ).format(schema),
                        (event_id, topic, key, payload),
                    )
        except psycopg.Error as exc:
            raise _Refused(f"{type(exc).__name__}: {exc}") from None
        inp.ids = [str(event_id)]

    # -- the end -----------------------------------------------------------------------------------

    def new_log(self) -> str:
        """What the relay logged since the last call."""
        data = self.log_path.read_bytes()
        new, self.log_read = data[self.log_read :], len(data)
        return new.decode("utf-8", "backslashreplace")

    def stop(self) -> int | None:
        """SIGTERM the relay; its exit code (None if it had to be killed)."""
        if self.relay.poll() is None:
            self.relay.terminate()
            try:
                return self.relay.wait(60)
            except subprocess.TimeoutExpired:
                self.relay.kill()
                self.relay.wait()
                return None
        return self.relay.returncode

    def close(self) -> None:
        self.stop()
        self._log.close()
        self.receiver.close()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for name, schema in self.schemas.items():
                if name == "wal":
                    slot = capture.state(conn, schema).slot
                    conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                                 "WHERE slot_name = %s AND NOT active", (slot,))  # fmt: skip
                    conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(
                        sql.Identifier(capture.publication_name(schema))))  # fmt: skip
                conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))
            for role in (
                self.writer_login,
                self.stranger,
                self.roles.writer,
                self.roles.relay,
                self.roles.console,
            ):
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def _through_door(inp: Input, key: str) -> None:
    """A good event's fields (topic, key, payload, headers) as its door takes them, beside them."""
    f = inp.fields
    f["key"] = key
    if inp.door == "api":
        f["events"] = [{"topic": f["topic"], "payload": f["payload"], "key": key, "headers": f["headers"]}]
    elif inp.door == "sql":
        f |= {
            "event_id": str(uuid.uuid4()), "headers": json.dumps(f["headers"]), "type": None, "subject": None,
            "available_at": None, "expires_at": None, "key": key.encode(), "good_key": key,
        }  # fmt: skip
    elif inp.door == "emit":
        from outbox.capture import wal_message
        from outbox.events import EncodedEvent

        event_id = uuid.uuid4()
        f["messages"] = [
            wal_message.encode(
                EncodedEvent(event_id, f["topic"], key.encode(), f["payload"], f["headers"], 0.0)
            )
        ]
        f["id"] = str(event_id)


class _Refused(Exception):
    """A door refused the input: nothing was written (the checker judges the error)."""


FINAL = frozenset({"delivered", "dead", "later", "parked", "behind"})
# An event's state in one outbox (see World.states).
STATES = """
SELECT event_id::text, 'delivered' FROM {s}.delivered WHERE event_id = ANY(%(ids)s::uuid[])
UNION ALL
SELECT event_id::text, 'dead' FROM {s}.dead_letters WHERE event_id = ANY(%(ids)s::uuid[])
UNION ALL
SELECT e.event_id::text,
       CASE WHEN e.available_at > now() + interval '1 second' THEN 'later'
            WHEN EXISTS (SELECT 1 FROM {s}.dead_letters AS d WHERE d.parked AND d.key = e.key) THEN 'parked'
            WHEN EXISTS (SELECT 1 FROM {s}.events AS o WHERE o.key = e.key AND o.id < e.id
                         AND o.available_at > now() + interval '1 second') THEN 'behind'
            ELSE 'pending' END
FROM {s}.events AS e WHERE e.event_id = ANY(%(ids)s::uuid[])
"""
