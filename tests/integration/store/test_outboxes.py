"""Many outboxes from one command line: migrate and status over --outbox, --schemas and
--outboxes-file, one line per outbox, one failure not stopping the others."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

import outbox
from outbox.cli import main
from outbox.store import migrate as migrations
from outbox.store.migrate import migrate
from outbox.store.outboxes import discover

UNREACHABLE = "postgresql://app:s3cret@127.0.0.1:1/nowhere?connect_timeout=2"


def _schemas(pg_dsn: str, *names: str) -> None:
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in names:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))


def test_migrate_every_schema_matching_a_glob_then_status_all(
    pg_dsn: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _schemas(pg_dsn, f"{prefix}_a", f"{prefix}_b", f"{prefix}_c", f"{prefix}x_other")
    assert main(["migrate", "--dsn", pg_dsn, "--schemas", f"{prefix}_*"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out[:-1]] == [f"{prefix}_a", f"{prefix}_b", f"{prefix}_c"]
    assert all("applied 0001_initial" in line for line in out[:-1])
    assert out[-1] == "3 of 3 outboxes migrated"
    # Again: every one up to date; the schema that did not match was left alone.
    assert main(["migrate", "--dsn", pg_dsn, "--schemas", f"{prefix}_*"]) == 0
    assert capsys.readouterr().out.count("up to date") == 3
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT to_regclass(%s)", (f"{prefix}x_other.events",)).fetchone() == (None,)
        outbox.enqueue(conn, "orders", {"n": 1}, key="k", schema=f"{prefix}_b")
        outbox.enqueue(conn, "orders", {"n": 2}, key="k", schema=f"{prefix}_b")
        conn.commit()

    assert main(["status", "--all", "--dsn", pg_dsn, "--schemas", f"{prefix}_*", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["outboxes"]}
    assert set(rows) == {f"{prefix}_a", f"{prefix}_b", f"{prefix}_c"}
    assert rows[f"{prefix}_b"]["pending"] == 2 and rows[f"{prefix}_a"]["pending"] == 0
    assert rows[f"{prefix}_b"]["oldest_pending_age_seconds"] >= 0
    assert main(["status", "--all", "--dsn", pg_dsn, "--schemas", f"{prefix}_*"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[0].startswith("outbox ") and "no live relay" in lines[2]
    assert lines[-1] == "3 outboxes, 0 unreadable; 2 pending, 0 dead letters"


def test_migrate_over_many_schemas_takes_a_fresh_session_every_few(
    pg_dsn: str, prefix: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A session that migrated many outboxes walks all their functions' plans at every DDL
    # statement: migrations.PER_CONNECTION (50) on one session, then a fresh one. Here 2, over 5.
    names = [f"{prefix}_{i}" for i in range(5)]
    _schemas(pg_dsn, *names)
    monkeypatch.setattr(migrations, "PER_CONNECTION", 2)
    sessions: list[int] = []
    real = migrations.migrate

    def recorded(conn: psycopg.Connection[Any], schema: str, **kw: Any) -> Any:
        sessions.append(conn.info.backend_pid)
        return real(conn, schema, **kw)

    monkeypatch.setattr(migrations, "migrate", recorded)
    assert main(["migrate", "--dsn", pg_dsn, "--schemas", f"{prefix}_*"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "5 of 5 outboxes migrated"
    assert len(sessions) == 5 and [sessions.count(pid) for pid in dict.fromkeys(sessions)] == [2, 2, 1]


def test_one_failing_outbox_does_not_stop_the_others_and_shows_no_password(
    pg_dsn: str, prefix: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listed = tmp_path / "outboxes"
    listed.write_text(f"# two tenants\nfirst={pg_dsn}#{prefix}_1\n\nlost={UNREACHABLE}#{prefix}_2\n")
    assert main(["migrate", "--outboxes-file", str(listed), "--outbox", f"second={pg_dsn}#{prefix}_3"]) == 1
    out = capsys.readouterr().out
    assert f"first: schema {prefix}_1: applied 0001_initial" in out
    assert f"second: schema {prefix}_3: applied" in out
    assert "lost: failed: cannot connect to PostgreSQL" in out and "2 of 3 outboxes migrated, 1 failed" in out
    assert "s3cret" not in out

    assert main(["status", "--outboxes-file", str(listed), "--json"]) == 1  # an outbox list: --all
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["outboxes"]}
    assert rows["first"]["pending"] == 0 and "cannot connect" in rows["lost"]["error"]
    assert "s3cret" not in json.dumps(rows)


def test_a_schema_not_migrated_to_this_version_is_named_not_served(
    pg_dsn: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    _schemas(pg_dsn, f"{prefix}_old")
    with psycopg.connect(pg_dsn) as conn:
        migrate(conn, f"{prefix}_new")
        migrate(conn, f"{prefix}_old")
        conn.execute(
            sql.SQL("DELETE FROM {}.schema_migrations WHERE version = 12").format(
                sql.Identifier(f"{prefix}_old")
            )
        )
        conn.commit()
    assert main(["status", "--dsn", pg_dsn, "--schemas", f"{prefix}_*", "--json"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["outboxes"]}
    assert rows[f"{prefix}_new"]["pending"] == 0
    assert "lacks migrations 0012_events_by_key" in rows[f"{prefix}_old"]["error"]


def test_the_default_outbox_and_an_outbox_list_do_not_mix(
    pg_dsn: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["migrate", "--dsn", pg_dsn, "--outbox", f"a={pg_dsn}#x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--dsn: with --outbox or --outboxes-file" in err
    assert main(["status", "--dsn", pg_dsn, "--dsn", pg_dsn]) == 2
    assert "several go with --schemas" in capsys.readouterr().err


def test_a_schema_dropped_while_a_glob_looks_at_it_is_left_out_not_raised(pg_dsn: str, prefix: str) -> None:
    """A tenant's schema dropped between the glob's listing and the look at its migrations (the
    relay's discovery, every few seconds) is simply not there: raised, it stopped a relay serving
    every other outbox (found by running the fleet test eight at a time). The drop is held
    uncommitted so that the listing sees the schema, and committed while the look waits for it."""
    kept, dropped = f"{prefix}_kept", f"{prefix}_dropped"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, kept)
        migrate(conn, dropped)
    dropper = psycopg.connect(pg_dsn)
    dropper.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(dropped)))
    timer = threading.Timer(1.0, dropper.commit)  # the look is blocked on its lock by then
    timer.start()
    try:
        with psycopg.connect(pg_dsn) as conn:
            served, skipped = discover(conn, f"{prefix}_*", pg_dsn)
    finally:
        timer.join()
        dropper.close()
    assert [o.schema for o in served] == [kept] and skipped == {}


def test_a_schema_found_migrated_before_is_listed_but_not_looked_into_again(pg_dsn: str, prefix: str) -> None:
    """A relay's discovery reads each new tenant's migrations once: the schemas an earlier look
    served are only listed (200 tenants' migrations read every 2 s took a loaded relay seconds
    a look, and their outboxes' leases lapsed meanwhile). A tenant not known is still refused
    when it lacks a migration; a known one that is dropped is gone from the list."""
    a, b, gone = f"{prefix}_a", f"{prefix}_b", f"{prefix}_gone"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for schema in (a, b, gone):
            migrate(conn, schema)
        # b now looks as if an older version migrated it: a look would refuse it
        conn.execute(sql.SQL("DELETE FROM {}.schema_migrations WHERE version = 1").format(sql.Identifier(b)))
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(gone)))
        served, skipped = discover(conn, f"{prefix}_*", pg_dsn)
        assert [o.schema for o in served] == [a] and list(skipped) == [b], skipped
        served, skipped = discover(conn, f"{prefix}_*", pg_dsn, known={a, b, gone})
        assert [o.schema for o in served] == [a, b] and skipped == {}


def test_the_relays_discovery_looks_into_a_tenant_once(pg_dsn: str, prefix: str) -> None:
    """The relay's finder passes what it served to the next look: a tenant served once is served
    by the next look too, even if its migrations would no longer be read as complete."""
    from outbox.cli import build_parser
    from outbox.cli.relay import _finder

    a, b = f"{prefix}_a", f"{prefix}_b"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, a)
        migrate(conn, b)
    args = build_parser().parse_args(
        ["relay", "--kafka-bootstrap", "k:1", "--dsn", pg_dsn, "--schemas", f"{prefix}_*"]
    )
    find = _finder(args)
    first = find()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DELETE FROM {}.schema_migrations WHERE version = 1").format(sql.Identifier(b)))
    second = find()
    assert first is not None and second is not None
    assert [o.schema for o in first.outboxes] == [o.schema for o in second.outboxes] == [a, b]


def test_a_schema_the_role_may_not_read_is_named_not_served_and_the_look_goes_on(
    pg_dsn: str, prefix: str
) -> None:
    """A role without privileges on a tenant's schema: that tenant is skipped with the server's
    reason, the others are still found (an error there used to end the look, and a relay)."""
    readable, closed, role = f"{prefix}_open", f"{prefix}_closed", f"{prefix}_role"
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, readable)
        migrate(conn, closed)
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(sql.Identifier(readable), sql.Identifier(role))
        )
        conn.execute(
            sql.SQL("GRANT SELECT ON {}.schema_migrations TO {}").format(
                sql.Identifier(readable), sql.Identifier(role)
            )
        )
    try:
        with psycopg.connect(make_conninfo(pg_dsn, user=role)) as conn:
            served, skipped = discover(conn, f"{prefix}_*", pg_dsn)
    finally:
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            for schema in (readable, closed):
                conn.execute(
                    sql.SQL("REVOKE ALL ON SCHEMA {} FROM {}").format(
                        sql.Identifier(schema), sql.Identifier(role)
                    )
                )
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
    assert [o.schema for o in served] == [readable]
    assert list(skipped) == [closed] and "cannot be read: permission denied" in skipped[closed], skipped


def test_a_look_that_fails_midway_is_one_line_for_that_database_not_a_traceback(
    pg_dsn: str, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """The database answers, but the look for outboxes fails partway (here a statement timeout
    while another session locks a tenant's migrations table): that database is reported as
    unreadable, with the reason, and the command goes on (a relay keeps that database's outboxes
    as they were). It used to end the command, and the relay, with a database error."""
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        migrate(conn, f"{prefix}_a")
    locker = psycopg.connect(pg_dsn)
    try:
        locker.execute(
            sql.SQL("LOCK TABLE {}.schema_migrations IN ACCESS EXCLUSIVE MODE").format(
                sql.Identifier(f"{prefix}_a")
            )
        )
        dsn = make_conninfo(pg_dsn, options="-c statement_timeout=300")
        code = main(["status", "--dsn", dsn, "--schemas", f"{prefix}_*", "--json"])
    finally:
        locker.close()
    out = capsys.readouterr()
    assert code == 1, out
    errors = [r.get("error", "") for r in json.loads(out.out)["outboxes"]]
    assert any(
        "cannot look for outboxes: canceling statement due to statement timeout" in e for e in errors
    ), out
    assert "Traceback" not in out.err
