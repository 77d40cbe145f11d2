"""Other database roles and tenants are not trusted: each attack mounted on the real PostgreSQL.

- Any role that can log in may call ``pg_logical_emit_message`` (PostgreSQL grants it to
  PUBLIC): in WAL capture it must not get an event delivered, forge an event id, or park a key.
- The writer role appends events; it must not choose the relay's columns.
- A tenant who owns a schema that ``--schemas`` finds must not run code as the relay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import errors, sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox import capture
from outbox.capture import wal_message
from outbox.cli import main
from outbox.events import encode_event
from outbox.relay.relay import RelayConfig
from outbox.store.migrate import migrate
from tests.helpers import (
    FAST,
    ModuleProcess,
    count,
    login_in,
    read_topic,
    recorded_slot,
    running_relay,
    wait_for,
)


@pytest.fixture
def intruder(wal_dsn: str) -> Iterator[str]:
    """A login role with no grant at all (a DSN to it), dropped after."""
    name = f"intruder_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    yield make_conninfo(wal_dsn, user=name)
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP OWNED BY {} CASCADE").format(sql.Identifier(name)))
        conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_a_role_without_the_writer_grant_cannot_get_a_wal_event_delivered(
    wal_dsn: str, wal_schema: str, intruder: str, kafka: str, topic: str
) -> None:
    """The intruder re-emits a genuine event's message (same id, another topic, a parked-worthy
    key) unsigned, with a signature of its own making, and as garbage; it cannot call the
    writers' function. None of it is delivered or takes a real event's id: each is a dead letter
    under a new id, without a key. The genuine events (one after the forgeries) are delivered."""
    with psycopg.connect(wal_dsn) as conn:
        genuine = outbox.enqueue(conn, topic, {"real": True}, key="acct-1", schema=wal_schema)
    stolen = encode_event(f"{topic}-stolen", {"forged": True}, key="acct-1", headers={"x": "y"})
    forged = dataclasses.replace(stolen, event_id=genuine)
    content = b"%f\n" % time.time() + wal_message.encode(forged)
    prefix = capture.prefix_of(wal_schema)
    with psycopg.connect(intruder, autocommit=True) as conn:
        for message in (content, os.urandom(wal_message.SIGNATURE_BYTES) + content, b"garbage"):
            conn.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (prefix, message))
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute(
                sql.SQL("SELECT {}.emit_events(ARRAY[%s::bytea])").format(sql.Identifier(wal_schema)),
                (content,),
            )
    with psycopg.connect(wal_dsn) as conn:
        after = outbox.enqueue(conn, topic, {"real": "after"}, key="acct-1", schema=wal_schema)
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 2, timeout=30, what="the genuine events")
        wait_for(lambda: count(wal_dsn, wal_schema, "dead_letters") == 3, timeout=30, what="the forgeries")
        messages = read_topic(kafka, topic, 2)
    assert [m.event_id for m in messages] == [str(genuine), str(after)]
    assert read_topic(kafka, f"{topic}-stolen", 0, timeout=2) == []
    with psycopg.connect(wal_dsn) as conn:
        dead = conn.execute(
            sql.SQL("SELECT event_id, topic, key, payload, error, parked FROM {}.dead_letters").format(
                sql.Identifier(wal_schema)
            )
        ).fetchall()
    assert all(
        event_id != genuine and t == "(unsigned)" and k is None and not p for event_id, t, k, _, _, p in dead
    )
    assert all("signature does not verify" in error for *_, error, _ in dead)
    payloads = [bytes(payload) for _, _, _, payload, _, _ in dead]  # each kept whole: nothing lost
    assert b"garbage" in payloads and sum(p.endswith(wal_message.encode(forged)) for p in payloads) == 2


def test_a_signed_message_that_is_no_event_is_dead_lettered_and_the_reader_goes_on(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """A writer's own SQL through emit_events: an id that is no UUID, a topic with NUL, headers
    that are no JSON or hold what jsonb refuses. Each is a dead letter (corrupt_event); the
    reader never stops on one, and the event committed after them is delivered."""
    ok_id = str(uuid.uuid4())
    bad = [
        b'["not-a-uuid","t",null,null,null]\n\npayload',
        b'["%s","a\\u0000b",null,null,null]\n\npayload' % ok_id.encode(),
        b'["%s","t",null,null,null]\n{not json\npayload' % ok_id.encode(),
        b'["%s","t",null,null,null]\n{"h":"\\ud800"}\npayload' % ok_id.encode(),
        b'["%s","t",null,null,null]\n{"a b":"v"}\npayload' % ok_id.encode(),
    ]
    with psycopg.connect(wal_dsn) as conn:
        conn.execute(sql.SQL("SELECT {}.emit_events(%s::bytea[])").format(sql.Identifier(wal_schema)), (bad,))
        conn.commit()
        good = outbox.enqueue(conn, topic, b"good", key="k", schema=wal_schema)
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 1, timeout=30, what="the good event")
        wait_for(
            lambda: count(wal_dsn, wal_schema, "dead_letters") == len(bad), timeout=30, what="dead letters"
        )
        (message,) = read_topic(kafka, topic, 1)
    assert message.event_id == str(good)
    with psycopg.connect(wal_dsn) as conn:
        errors_ = [
            r[0]
            for r in conn.execute(
                sql.SQL("SELECT error FROM {}.dead_letters ORDER BY id").format(sql.Identifier(wal_schema))
            )
        ]
    assert all(
        e.startswith(("corrupt event row: ", "a signed WAL message that is no outbox event")) for e in errors_
    ), errors_


def test_the_writer_role_emits_signed_wal_events_that_the_relay_delivers(
    wal_dsn: str, wal_schema: str, kafka: str, topic: str
) -> None:
    """The writer role may execute emit_events (migrate --roles), and what it emits is signed."""
    with login_in(wal_dsn, wal_schema, "writer") as writer, psycopg.connect(writer) as conn:
        event_id = outbox.enqueue(conn, topic, b"from the writer role", key="k", schema=wal_schema)
        conn.commit()
    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        (message,) = read_topic(kafka, topic, 1)
    assert message.event_id == str(event_id) and message.value == b"from the writer role"
    assert count(wal_dsn, wal_schema, "dead_letters") == 0


# -- the writer role --------------------------------------------------------------------------


@pytest.fixture
def writer(pg_dsn: str, schema: str) -> Iterator[str]:
    """A login role in the outbox's writer role (a DSN to it)."""
    with login_in(pg_dsn, schema, "writer") as dsn:
        yield dsn


@pytest.mark.parametrize(
    "statement",
    [
        # An id of its choosing: before the events of other writers in the claim order.
        "INSERT INTO {s}.events (id, event_id, topic, payload) OVERRIDING SYSTEM VALUE "
        "VALUES (1, gen_random_uuid(), 't', 'x')",
        "INSERT INTO {s}.events (event_id, topic, payload, attempts) VALUES (gen_random_uuid(), 't', 'x', 9)",
        "INSERT INTO {s}.events (event_id, topic, payload, created_at) "
        "VALUES (gen_random_uuid(), 't', 'x', '2000-01-01')",
        "INSERT INTO {s}.events (event_id, topic, payload, last_error) VALUES (gen_random_uuid(), 't', 'x', 'e')",
        "SELECT key FROM {s}.capture_key",
    ],
)
def test_the_writer_role_cannot_choose_the_relays_columns(writer: str, schema: str, statement: str) -> None:
    with psycopg.connect(writer) as conn:
        with pytest.raises(errors.InsufficientPrivilege):
            conn.execute(sql.SQL(statement).format(s=sql.Identifier(schema)))
        conn.rollback()
        outbox.enqueue(conn, "t", b"allowed", key="k", headers={"h": "v"}, delay=1, schema=schema)
        outbox.enqueue_many(conn, [{"topic": "t", "payload": b"x"}] * 3, schema=schema)


def test_a_strangers_message_is_never_redriven_with_the_others(
    wal_dsn: str, wal_schema: str, intruder: str
) -> None:
    """A stranger's WAL message is dead-lettered unsigned_event, a signed one that is no event
    corrupt_event. Neither is taken by a bulk redrive (`dead redrive --all`, `retry`, the console's
    "redrive all…"): with a catch-all webhook route, the stranger's content would be POSTed. By its
    id, with --include-unverified, it goes: knowingly."""
    from starlette.testclient import TestClient

    from outbox.cli import main
    from outbox.console.web import app
    from tests.sink_servers import HttpTarget

    hooks = HttpTarget()
    prefix = capture.prefix_of(wal_schema)
    with psycopg.connect(intruder, autocommit=True) as conn:
        conn.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (prefix, b"a stranger's content"))
    with psycopg.connect(wal_dsn) as conn:
        conn.execute(
            sql.SQL("SELECT {}.emit_events(%s::bytea[])").format(sql.Identifier(wal_schema)), ([b"no event"],)
        )
        conn.commit()
        outbox.enqueue(conn, "orders.created", {"n": 1}, key="k", schema=wal_schema)
    route = f"*=http://127.0.0.1:{hooks.receiver.port}{hooks.path}"
    with ModuleProcess(
        "outbox", "relay", "--dsn", wal_dsn, "--schema", wal_schema, "--route", route, *FAST
    ) as relay:
        wait_for(lambda: count(wal_dsn, wal_schema, "dead_letters") == 2 and len(hooks.fetch()) == 1, timeout=30,
                 what=f"the dead letters and the event\n{relay.output()[-2000:]}")  # fmt: skip
        with psycopg.connect(wal_dsn) as conn:
            kinds = conn.execute(
                sql.SQL("SELECT kind, id FROM {}.dead_letters ORDER BY kind").format(
                    sql.Identifier(wal_schema)
                )
            ).fetchall()
        assert [k for k, _ in kinds] == ["corrupt_event", "unsigned_event"]
        stranger = next(i for k, i in kinds if k == "unsigned_event")
        base = ["--dsn", wal_dsn, "--schema", wal_schema]
        assert main(["dead", "redrive", *base, "--all", "--yes"]) == 1  # nothing matches
        assert main(["retry", *base, "--yes"]) == 1
        assert main(["dead", "redrive", *base, "--all", "--include-unverified", "--yes"]) == 2  # by id only
        assert main(["dead", "list", *base]) == 0  # listed, and skipped, like any
        same = {"sec-fetch-site": "same-origin"}
        with TestClient(app(wal_dsn, schema=wal_schema), base_url="http://localhost:8000") as console:
            page = console.get("/dead").text
            assert "Not a verified event of this outbox" in page and "redrive…" not in page
            hw = page.split('name="hw" value="', 1)[1].split('"', 1)[0]
            preview = console.post("/dead/preview", data={"action": "redrive", "hw": hw}, headers=same)
            assert 'id="unverified-left"><b>2</b>' in preview.text
            act = console.post(
                "/dead/act", data={"action": "redrive", "hw": hw}, headers=same, follow_redirects=False
            )
            assert act.status_code == 303 and "n=0" in act.headers["location"]
            event = console.get(f"/event/{_event_id(wal_dsn, wal_schema, stranger)}").text
            assert f"outbox dead redrive --ids {stranger} --include-unverified" in event
        with psycopg.connect(wal_dsn) as conn:  # an event after: once it is delivered, the relay has looked
            outbox.enqueue(conn, "orders.created", {"n": 2}, key="k", schema=wal_schema)
        wait_for(lambda: len(hooks.fetch()) == 2, timeout=30, what="the second event")
        assert count(wal_dsn, wal_schema, "dead_letters") == 2
        assert all(b"stranger" not in m.value for m in hooks.fetch()), "a stranger's message was delivered"
        assert main(["dead", "redrive", *base, "--ids", str(stranger), "--include-unverified", "--yes"]) == 0
        wait_for(lambda: any(b"a stranger's content" in m.value for m in hooks.fetch()), timeout=30,
                 what="the knowingly redriven message")  # fmt: skip
        assert relay.stop() == 0
    hooks.close()


def _event_id(dsn: str, schema: str, dead_id: int) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT event_id::text FROM {}.dead_letters WHERE id = %s").format(
                sql.Identifier(schema)
            ),
            (dead_id,),
        ).fetchone()
    assert row is not None
    return str(row[0])


def test_a_message_outside_any_transaction_holds_no_slot_back_and_is_no_event(
    wal_dsn: str, wal_schema: str, intruder: str, kafka: str, topic: str
) -> None:
    """Any role may emit a non-transactional message under the outbox's prefix. It arrives between
    transactions; kept by the reader, it held the idle slot's feedback (WAL retained) until the next
    outbox transaction, which then dead-lettered it. It is passed over: the slot moves past it while
    the outbox is idle, and nothing of it becomes a dead letter."""
    slot = recorded_slot(wal_dsn, wal_schema)

    def confirmed_past(lsn: str) -> bool:
        with psycopg.connect(wal_dsn) as conn:
            row = conn.execute(
                "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s",
                (lsn, slot),
            ).fetchone()
        return bool(row and row[0])

    with running_relay(RelayConfig(wal_dsn, schema=wal_schema, poll_interval=0.1), bootstrap=kafka):
        with psycopg.connect(wal_dsn) as conn:
            first = outbox.enqueue(conn, topic, {"n": 1}, key="k", schema=wal_schema)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 1, timeout=30, what="the first event")
        with psycopg.connect(intruder, autocommit=True) as conn:
            row = conn.execute(
                "SELECT pg_logical_emit_message(false, %s, 'not in a transaction')::text",
                (capture.prefix_of(wal_schema),),
            ).fetchone()
        assert row is not None
        wait_for(lambda: confirmed_past(row[0]), timeout=20, what="the idle slot confirmed past the message")
        with psycopg.connect(wal_dsn) as conn:
            second = outbox.enqueue(conn, topic, {"n": 2}, key="k", schema=wal_schema)
        wait_for(lambda: count(wal_dsn, wal_schema, "delivered") == 2, timeout=30, what="the second event")
    assert count(wal_dsn, wal_schema, "dead_letters") == 0
    assert [m.event_id for m in read_topic(kafka, topic, 2)] == [str(first), str(second)]


# -- who reads the WAL signing keys -------------------------------------------------------------


def _reads_key(dsn: str, schema: str, table: str) -> bool:
    with psycopg.connect(dsn) as conn:
        try:
            conn.execute(
                sql.SQL("SELECT key FROM {}.{}").format(sql.Identifier(schema), sql.Identifier(table))
            )
        except errors.InsufficientPrivilege:
            return False
    return True


def _check_grants(dsn: str, schema: str, *extra: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["migrate", "--dsn", dsn, "--schema", schema, "--check-grants", *extra])
    return code, out.getvalue()


def test_a_role_given_default_privileges_cannot_read_the_signing_key_and_check_grants_names_any_that_can(
    pg_dsn: str,
) -> None:
    """A reporting role given SELECT on future tables (ALTER DEFAULT PRIVILEGES, a common set-up)
    got SELECT on capture_key and capture_keys when migrate made them, read the key and could sign
    events the relay delivered; --check-grants said nothing. Now migrate leaves it no table grant
    on them; a column grant made by hand is named by --check-grants (exit 1) and revoked by
    --roles; a member of pg_read_all_data, which no REVOKE reaches, is named too."""
    tag = uuid.uuid4().hex[:8]
    reporting, reads_all, schema = f"reporting_{tag}", f"reads_all_{tag}", f"k_{tag}"
    relay_role = f"relay_{tag}"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(reporting)))
        conn.execute(
            sql.SQL("ALTER DEFAULT PRIVILEGES FOR ROLE CURRENT_USER GRANT SELECT ON TABLES TO {}").format(
                sql.Identifier(reporting)
            )
        )
        has_all = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = 'pg_read_all_data'").fetchone()
        if has_all:  # PostgreSQL 14+
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN IN ROLE pg_read_all_data").format(sql.Identifier(reads_all))
            )
    reporter = make_conninfo(pg_dsn, user=reporting)
    try:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            migrate(conn, schema)
            conn.execute(
                sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(*map(sql.Identifier, (schema, reporting)))
            )
        assert _reads_key(reporter, schema, "events"), "the default privileges hold for other tables"
        assert not _reads_key(reporter, schema, "capture_key") and not _reads_key(
            reporter, schema, "capture_keys"
        )
        code, said = _check_grants(pg_dsn, schema, "--relay-role", relay_role)
        assert reporting not in said
        if has_all:
            assert (
                code == 1 and f"role {reads_all} may read the WAL signing keys of outbox {schema}" in said
            ), said
            assert "pg_read_all_data" in said
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("GRANT SELECT (id, key) ON {}.capture_keys TO {}").format(
                    sql.Identifier(schema), sql.Identifier(reporting)
                )
            )
        assert _reads_key(reporter, schema, "capture_keys")
        code, said = _check_grants(pg_dsn, schema, "--relay-role", relay_role)
        assert code == 1 and f"role {reporting} may read the WAL signing keys of outbox {schema}" in said, (
            said
        )
        assert main_ok(["migrate", "--dsn", pg_dsn, "--schema", schema, "--roles", "--relay-role", relay_role,
                        "--writer-role", f"writer_{tag}", "--console-role", f"console_{tag}"])  # fmt: skip
        assert not _reads_key(reporter, schema, "capture_keys")
        code, said = _check_grants(pg_dsn, schema, "--relay-role", relay_role)
        assert reporting not in said and relay_role not in said, said
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "ALTER DEFAULT PRIVILEGES FOR ROLE CURRENT_USER REVOKE SELECT ON TABLES FROM {}"
                ).format(sql.Identifier(reporting))
            )
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            for role in (reporting, reads_all, relay_role, f"writer_{tag}", f"console_{tag}"):
                if conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone():
                    conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                    conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def main_ok(argv: list[str]) -> bool:
    return main(argv) == 0
