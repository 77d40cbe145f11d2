"""``outbox relay`` over many outboxes, as a process: schemas found by a glob in two databases and
again while it runs, an outboxes file re-read on SIGHUP, two relays sharing 50 outboxes with
one of them SIGKILLed, /readyz and /metrics per outbox."""

from __future__ import annotations

import collections
import signal
import threading
import time
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from outbox_bench.harness.proxy import Proxy
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox.harness.embedded import free_port
from outbox.store.migrate import migrate
from tests.helpers import (
    FAST,
    ModuleProcess,
    assert_per_key_order,
    count,
    http_get,
    read_topic,
    wait_for,
    write_rounds,
)
from tests.pgserver import Server


def _status(port: int) -> int:
    """/readyz's status, 0 while nothing listens yet."""
    try:
        return http_get(port, "/readyz")[0]
    except OSError:
        return 0


def _migrate(dsn: str, *schemas: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for schema in schemas:
            migrate(conn, schema)


def _write(dsn: str, schema: str, topic: str, keys: int, rounds: int, first: int = 0) -> None:
    """``rounds`` transactions of one event per key; the keys are this outbox's own."""
    dbname = conninfo_to_dict(dsn)["dbname"]
    write_rounds(dsn, schema, topic, keys, rounds, first, key_prefix=f"{dbname}.{schema}-")


def test_schemas_of_two_databases_found_by_a_glob_and_again_while_it_runs(
    pg_dsn: str, second_db: str, kafka: str, topic: str, prefix: str
) -> None:
    _migrate(pg_dsn, f"{prefix}_a", f"{prefix}_b")
    _migrate(second_db, f"{prefix}_a")
    db1, db2 = (conninfo_to_dict(d)["dbname"] for d in (pg_dsn, second_db))
    port = free_port()
    relay = ModuleProcess(
        "outbox", "relay", "--dsn", pg_dsn, "--dsn", second_db, "--schemas", f"{prefix}_*",
        "--discover-every", "1", "--kafka-bootstrap", kafka, "--metrics-port", str(port), *FAST,
    )  # fmt: skip
    try:
        wait_for(lambda: _status(port) == 200, timeout=30, what="ready")
        for dsn, schema in ((pg_dsn, f"{prefix}_a"), (pg_dsn, f"{prefix}_b"), (second_db, f"{prefix}_a")):
            _write(dsn, schema, topic, 5, 4)
        wait_for(lambda: count(pg_dsn, f"{prefix}_a", "delivered") == 20, timeout=30, what="db1 a")
        wait_for(lambda: count(pg_dsn, f"{prefix}_b", "delivered") == 20, timeout=30, what="db1 b")
        wait_for(lambda: count(second_db, f"{prefix}_a", "delivered") == 20, timeout=30, what="db2 a")
        # A tenant migrated while the relay runs is served within the discovery interval.
        _migrate(second_db, f"{prefix}_c")
        _write(second_db, f"{prefix}_c", topic, 5, 4)
        wait_for(
            lambda: count(second_db, f"{prefix}_c", "delivered") == 20, timeout=30, what="the new tenant"
        )
        status, ready = http_get(port, "/readyz")
        names = [f"{db1}.{prefix}_a", f"{db1}.{prefix}_b", f"{db2}.{prefix}_a", f"{db2}.{prefix}_c"]
        assert status == 200 and all(f"outbox {n}: ready" in ready for n in names), ready
        _, metrics = http_get(port, "/metrics")
        for n in names:
            assert f'outbox_events_delivered_total{{outbox="{n}",topic="{topic}"' in metrics, n
        # A dropped tenant is let go, and says so.
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(f"{prefix}_b")))
        wait_for(lambda: f"{db1}.{prefix}_b" not in http_get(port, "/readyz")[1], timeout=30, what="let go")
        assert relay.stop() == 0
        log = relay.output()
    except BaseException:
        print(relay.output()[-6000:])  # shown with a failure (a CI run found the relay gone here)
        raise
    finally:
        relay.close()
    assert f"outbox {db1}.{prefix}_b is no longer served" in log, log[-3000:]
    assert "password" not in log
    messages = read_topic(kafka, topic, 80)
    assert len({m.event_id for m in messages}) == 80
    assert_per_key_order(messages)


def test_an_outboxes_file_is_read_again_on_sighup(
    pg_dsn: str, kafka: str, topic: str, prefix: str, tmp_path: object
) -> None:
    from pathlib import Path

    listed = Path(str(tmp_path)) / "outboxes"
    first, second = f"{prefix}_1", f"{prefix}_2"
    _migrate(pg_dsn, first, second)
    listed.write_text(f"# tenants\nfirst={pg_dsn}#{first}\n")
    port = free_port()
    relay = ModuleProcess(
        "outbox", "relay", "--outboxes-file", str(listed), "--kafka-bootstrap", kafka,
        "--metrics-port", str(port), *FAST,
    )  # fmt: skip
    try:
        _write(pg_dsn, first, topic, 3, 2)
        _write(pg_dsn, second, topic, 3, 2)
        wait_for(lambda: count(pg_dsn, first, "delivered") == 6, timeout=30, what="the listed outbox")
        assert count(pg_dsn, second, "delivered") == 0  # not listed: not served
        wait_for(lambda: _status(port) == 200, timeout=30, what="ready")
        lines = http_get(port, "/readyz")[1].splitlines()
        assert [line for line in lines if line.startswith("outbox ")] == ["outbox first: ready"], lines
        listed.write_text(f"first={pg_dsn}#{first}\nsecond={pg_dsn}#{second}\n")
        relay.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: count(pg_dsn, second, "delivered") == 6, timeout=30, what="served after SIGHUP")
        lines = http_get(port, "/readyz")[1].splitlines()
        assert "outbox first: ready" in lines and "outbox second: ready" in lines, lines
        assert relay.stop() == 0
        assert "reading the list of outboxes again" in relay.output()
    finally:
        relay.close()


@pytest.mark.slow
def test_two_relays_share_fifty_outboxes_and_one_is_killed_mid_drain(
    pg_dsn: str, kafka: str, topic: str, prefix: str
) -> None:
    schemas = [f"{prefix}_{i}" for i in range(50)]
    _migrate(pg_dsn, *schemas)
    keys, rounds = 4, 25  # 100 events per outbox, 5,000 in all
    stop_writing = threading.Event()

    def write(schema: str) -> None:
        for seq in range(rounds):
            if stop_writing.is_set():
                return
            _write(pg_dsn, schema, topic, keys, 1, first=seq)

    relays = [
        ModuleProcess(
            "outbox",
            "relay",
            "--dsn",
            pg_dsn,
            "--schemas",
            f"{prefix}_*",
            "--kafka-bootstrap",
            kafka,
            "--name",
            f"r{i}",
            *FAST,
        )
        for i in range(2)
    ]
    writers = [threading.Thread(target=write, args=(s,)) for s in schemas]
    try:
        for w in writers:
            w.start()
        total = lambda: sum(count(pg_dsn, s, "delivered") for s in schemas)  # noqa: E731
        wait_for(lambda: total() > 1000, timeout=60, what="both relays draining")

        def owners() -> collections.Counter[str]:
            found: collections.Counter[str] = collections.Counter()
            with psycopg.connect(pg_dsn) as conn:
                for s in schemas[:5]:
                    found.update(
                        r[0]
                        for r in conn.execute(
                            sql.SQL(
                                "SELECT r.name FROM {0}.partitions p JOIN {0}.relays r ON r.id = p.owner"
                            ).format(sql.Identifier(s))
                        ).fetchall()
                    )
            return found

        # Each outbox's partitions are shared out (a relay that starts slowly beside a loaded
        # suite joins a few heartbeats later: seen in CI, r1 owned all 320 when first looked at).
        try:
            wait_for(lambda: set(owners()) == {"r0", "r1"}, timeout=30, what="both relays owning partitions")
        except AssertionError:
            raise AssertionError(f"partitions of the first five outboxes by owner: {owners()}") from None
        relays[0].proc.send_signal(signal.SIGKILL)  # mid-drain
        relays[0].proc.wait(10)
        for w in writers:
            w.join()
        wait_for(lambda: total() == 50 * keys * rounds, timeout=120, what="the survivor drains everything")
        assert relays[1].stop() == 0
    finally:
        stop_writing.set()
        for r in relays:
            r.close()
    n = 50 * keys * rounds
    for s in schemas:
        assert count(pg_dsn, s, "events") == 0 and count(pg_dsn, s, "dead_letters") == 0, s
    messages = read_topic(kafka, topic, n, timeout=90)
    assert len({m.event_id for m in messages}) == n, "an event was lost"
    assert_per_key_order(messages)


@pytest.fixture
def other_server() -> Iterator[Server]:
    """A second PostgreSQL server (16, scripts/pg-matrix's machinery) on a free port."""
    server = Server("16").start()
    try:
        yield server
    finally:
        server.remove()


def _database(admin_dsn: str, name: str) -> str:
    """Create database ``name`` on ``admin_dsn``'s server; its DSN."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    return make_conninfo(admin_dsn, dbname=name)


def _undelivered(places: list[tuple[str, str]], each: int) -> list[str]:
    """The outboxes of ``places`` that have not archived ``each`` events yet, with their counts:
    one connection per database (one per outbox, 200 a poll, cost more than the relay's work on a
    loaded CI machine)."""
    by_db: dict[str, list[str]] = collections.defaultdict(list)
    for dsn, schema in places:
        by_db[dsn].append(schema)
    short = []
    for dsn, schemas in by_db.items():
        with psycopg.connect(dsn, autocommit=True) as conn:
            for schema in schemas:
                q = sql.SQL("SELECT (SELECT count(*) FROM {0}.delivered), (SELECT count(*) FROM {0}.events)")
                row = conn.execute(q.format(sql.Identifier(schema))).fetchone()
                if not row or row[0] != each:
                    short.append(f"{conninfo_to_dict(dsn)['dbname']}.{schema}: {row}")
    return short


def _why_short(places: list[tuple[str, str]], short: list[str], port: int, logs: str) -> None:
    """What a short outbox looks like, printed with the failure (seen once, on a machine at half
    its pace: one outbox of 203 archived nothing in 120 s, and its log lines had scrolled away)."""
    for dsn, schema in places:
        if not any(line.split(":")[0].endswith(f".{schema}") for line in short[:3]):
            continue
        with psycopg.connect(dsn, autocommit=True) as conn:
            q = sql.SQL(
                "SELECT owner, count(*), min(expires_at - now()), bool_or(releasing), "
                "max(fenced_until - now()) FROM {}.partitions GROUP BY owner"
            )
            print(schema, "partitions:", conn.execute(q.format(sql.Identifier(schema))).fetchall())
            q = sql.SQL("SELECT id, partition, attempts, available_at - now(), last_error FROM {}.events")
            print(schema, "events:", conn.execute(q.format(sql.Identifier(schema))).fetchall())
            q = sql.SQL(
                "SELECT pid, state, now() - xact_start, left(query, 80) FROM pg_stat_activity "
                "WHERE application_name LIKE 'outbox-%%' AND state <> 'idle'"
            )
            print("relay sessions not idle:", conn.execute(q).fetchall())
        print(schema, "in the relay's log:", [line for line in logs.splitlines() if schema in line][-20:])
        print(
            schema,
            "in /readyz:",
            [line for line in http_get(port, "/readyz")[1].splitlines() if schema in line],
        )


def _relay_sessions(dsn: str) -> int:
    """Sessions the relay holds in ``dsn``'s database (batches, heartbeat, LISTEN, vacuum, metrics)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
            "AND application_name LIKE 'outbox-%%' AND application_name <> 'outbox-cli'"
        ).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.slow
# 200 migrations are 35 s of DDL on a quiet machine, 125 s beside the suite's other long tests.
@pytest.mark.timeout(600)
def test_200_schemas_and_three_databases_on_two_servers_one_relay(
    pg_dsn: str, second_db: str, other_server: Server, kafka: str, topic: str, prefix: str
) -> None:
    t0 = time.monotonic()

    def phase(what: str) -> None:  # where the minutes go, printed with a failure
        print(f"{time.monotonic() - t0:6.1f} s  {what}", flush=True)

    tenants = [f"{prefix}_{i:03d}" for i in range(200)]
    _migrate(pg_dsn, *tenants)
    phase("200 schemas migrated")
    far = [_database(other_server.dsn, f"far_{i}") for i in range(2)]
    for dsn in (second_db, *far):
        _migrate(dsn, f"{prefix}_x")
    places = [(pg_dsn, t) for t in tenants] + [(dsn, f"{prefix}_x") for dsn in (second_db, *far)]
    port = free_port()
    dsns = [arg for dsn in (pg_dsn, second_db, *far) for arg in ("--dsn", dsn)]
    relay = ModuleProcess(
        "outbox", "relay", *dsns, "--schemas", f"{prefix}_*", "--discover-every", "2",
        "--kafka-bootstrap", kafka, "--metrics-port", str(port), *FAST,
        # The default ownership lease: FAST's 3 s is for takeover tests, and 203 outboxes would
        # heartbeat 338 times a second (5 a lease each), more than a loaded CI machine gives.
        # The relay's own batch lease and delivery timeout too: beside the suite on a slow
        # machine, one loop serving 203 outboxes took up to 20 s to settle a batch, past FAST's
        # 4 s lease, and an outbox whose batches lost their lease again and again was not
        # drained in 120 s. This test is about scale and isolation, not takeovers.
        "--ownership-lease", "10", "--lease", "30", "--delivery-timeout", "15",
    )  # fmt: skip
    keys, rounds = 2, 3

    def write(chunk: list[tuple[str, str]]) -> None:
        for dsn, schema in chunk:
            _write(dsn, schema, topic, keys, rounds)

    try:
        wait_for(lambda: _status(port) == 200, timeout=60, what="ready")
        phase("the relay is ready")
        writers = [threading.Thread(target=write, args=(places[i::8],)) for i in range(8)]
        for w in writers:
            w.start()
        # A tenant migrated on the other server while the relay runs is served too.
        _migrate(far[1], f"{prefix}_late")
        places.append((far[1], f"{prefix}_late"))
        _write(far[1], f"{prefix}_late", topic, keys, rounds)
        for w in writers:
            w.join()
        phase("written")
        each = keys * rounds
        short: list[str] = []

        def drained() -> bool:
            short[:] = _undelivered(places, each)
            return not short

        try:
            wait_for(drained, timeout=120, what="every outbox drained")
        except AssertionError:
            print(f"{len(short)} outboxes short (archived, pending): {short[:20]}")
            try:
                _why_short(places, short, port, relay.output())
            except Exception as exc:  # the diagnosis must not hide the failure
                print(f"(could not look closer: {exc!r})")
            raise
        phase("drained")
        # Bounded: 200 outboxes in a database are one relay's few sessions there, not 200.
        sessions = _relay_sessions(pg_dsn)
        assert 0 < sessions <= 8, f"{sessions} relay sessions in the database of 200 outboxes"
        _, ready = http_get(port, "/readyz")
        assert ready.count("\noutbox ") == len(places), ready[-500:]
        assert relay.stop() == 0
    finally:
        print(relay.output()[-6000:])  # shown with a failure
        relay.close()
    n = len(places) * keys * rounds
    messages = read_topic(kafka, topic, n, timeout=90)
    assert len({m.event_id for m in messages}) == n, "an event was lost or is missing"
    assert_per_key_order(messages)


@pytest.mark.slow
def test_one_database_stopped_and_another_blackholed_the_others_keep_flowing(
    pg_dsn: str, other_server: Server, kafka: str, topic: str, prefix: str
) -> None:
    stopped_dsn = _database(other_server.dsn, "stopped")
    frozen_db = _database(pg_dsn, f"outbox_fz_{uuid.uuid4().hex[:8]}")
    a, b, c = f"{prefix}_a", f"{prefix}_b", f"{prefix}_c"
    _migrate(pg_dsn, a)
    _migrate(stopped_dsn, b)
    _migrate(frozen_db, c)
    info = conninfo_to_dict(frozen_db)
    proxy = Proxy(str(info.get("host", "127.0.0.1")), int(info.get("port", 5432))).start()
    via_proxy = make_conninfo(frozen_db, host="127.0.0.1", port=str(proxy.port))
    relay = ModuleProcess(
        "outbox", "relay", "--outbox", f"a={pg_dsn}#{a}", "--outbox", f"b={stopped_dsn}#{b}",
        "--outbox", f"c={via_proxy}#{c}", "--kafka-bootstrap", kafka, "--log-format", "json",
        "--net-timeout", "3", "--stall-timeout", "4", *FAST,
    )  # fmt: skip
    written = {"a": 0}
    stop = threading.Event()

    def steady() -> None:  # outbox a: up to 50 transactions a second throughout, on one session
        import outbox

        key = f"{conninfo_to_dict(pg_dsn)['dbname']}.{a}-k0"
        with psycopg.connect(pg_dsn) as conn:
            seq = 0
            while not stop.wait(0.02):
                outbox.enqueue(conn, topic, {"k": key, "seq": seq}, key=key, schema=a)
                conn.commit()
                seq += 1
                written["a"] = seq

    writer = threading.Thread(target=steady)
    try:
        writer.start()
        _write(stopped_dsn, b, topic, 3, 2)
        _write(frozen_db, c, topic, 3, 2)
        wait_for(lambda: count(stopped_dsn, b, "delivered") == 6, timeout=30, what="b flowing")
        wait_for(lambda: count(frozen_db, c, "delivered") == 6, timeout=30, what="c flowing")
        other_server.stop()  # b's database goes away
        proxy.freeze()  # c's traffic is frozen: sockets open, no bytes
        _write(frozen_db, c, topic, 3, 2, first=2)  # the app still writes (directly)
        before, at = count(pg_dsn, a, "delivered"), written["a"]
        stop.wait(12)
        during, wrote = count(pg_dsn, a, "delivered") - before, written["a"] - at
        # a kept flowing: it delivered (about) what was written to it while the others were down.
        # (A connection per transaction wrote only 94 in 12 s beside the whole suite: one session
        # now writes them, and 50 are enough to tell a flowing outbox from a stalled one.)
        assert wrote >= 50 and during >= 0.8 * wrote, (
            f"a delivered {during} of {wrote} written during the fault"
        )
        other_server.start()
        proxy.heal()
        _write(stopped_dsn, b, topic, 3, 2, first=2)
        wait_for(lambda: count(stopped_dsn, b, "delivered") == 12, timeout=60, what="b drained")
        wait_for(lambda: count(frozen_db, c, "delivered") == 12, timeout=60, what="c drained")
        stop.set()
        writer.join()
        wait_for(lambda: count(pg_dsn, a, "delivered") == written["a"], timeout=30, what="a drained")
        assert relay.stop() == 0
        log = relay.output()
    finally:
        stop.set()
        relay.close()
        proxy.stop()
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE {} WITH (FORCE)").format(
                    sql.Identifier(conninfo_to_dict(frozen_db)["dbname"])
                )
            )
    # One line when each outage started and one when it ended, naming its outbox (the database's
    # sessions, its heartbeat: whichever met the fault first), and none about a.
    import json

    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    for name in ("b", "c"):
        mine = [
            e["event"]
            for e in lines
            if e.get("outbox") == name and e.get("event", "").endswith((".started", ".ended"))
        ]
        started = [e for e in mine if e.endswith(".started")]
        assert started and len(started) == len(set(started)), (name, mine)  # each problem once
        assert all(e.replace(".started", ".ended") in mine for e in started), (name, mine)  # and its end
    assert not [e for e in lines if e.get("outbox") == "a" and e.get("event", "").endswith(".started")]
    n = written["a"] + 12 + 12
    messages = read_topic(kafka, topic, n, timeout=90)
    assert len({m.event_id for m in messages}) == n
    assert_per_key_order(messages)
