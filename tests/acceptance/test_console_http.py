"""The console over real HTTP (``outbox console``, uvicorn): a web page in the operator's
browser is not trusted. DNS rebinding, framing and sniffing are mounted against the running
server; a replay that waits does not hold up the other pages."""

from __future__ import annotations

import http.client
import re
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql

import outbox
from outbox.harness.embedded import free_port
from tests.helpers import ModuleProcess, count, wait_for


@pytest.fixture
def console(pg_dsn: str, schema: str) -> Iterator[int]:
    """``outbox console`` without a password on a free loopback port (its port)."""
    port = free_port()
    proc = ModuleProcess(
        "outbox", "console", "--dsn", pg_dsn, "--schema", schema, "--port", str(port),
        "--allowed-host", "console.internal",
    )  # fmt: skip
    try:
        wait_for(lambda: _status(port, "/") == 200, timeout=30, what=f"the console\n{proc.output()}")
        yield port
    finally:
        proc.close()


def _request(
    port: int, path: str, *, host: str | None = None, method: str = "GET", body: str = "", **headers: str
) -> tuple[int, dict[str, str], str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True)
        conn.putheader("Host", host or f"127.0.0.1:{port}")
        for name, value in {
            **headers,
            **({"Content-Length": str(len(body))} if method == "POST" else {}),
        }.items():
            conn.putheader(name.replace("_", "-"), value)
        conn.endheaders(body.encode() if body else None)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        conn.close()


def _status(port: int, path: str) -> int:
    try:
        return _request(port, path)[0]
    except OSError:
        return 0


def test_a_rebound_host_name_gets_nothing_and_changes_nothing(pg_dsn: str, schema: str, console: int) -> None:
    """A page at rebind.evil.example whose name resolves to 127.0.0.1 is same-origin with itself:
    the browser lets it read the console's pages and post its forms with a matching Origin. Only
    the Host header says which name it used: refused, for reads and writes alike."""
    with psycopg.connect(pg_dsn) as conn:
        event_id = outbox.enqueue(conn, "orders.secret", {"card": "4111"}, key="k", schema=schema)
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, attempts, "
                "error, first_failed_at, failed_at, parked) VALUES (1, gen_random_uuid(), 'orders', 'k', 'x', "
                "'{{}}', now(), 1, 'boom', now(), now(), true)"
            ).format(sql.Identifier(schema))
        )
    evil = f"rebind.evil.example:{console}"
    for path in ("/", f"/event/{event_id}", "/dead", "/audit"):
        status, _, page = _request(console, path, host=evil)
        assert status == 421 and "orders.secret" not in page and "4111" not in page, (path, status)
    status, _, _ = _request(
        console, "/dead/act", host=evil, method="POST", body="action=redrive&hw=1&id=1",
        Origin=f"http://{evil}", Content_Type="application/x-www-form-urlencoded",
    )  # fmt: skip
    assert status == 421 and count(pg_dsn, schema, "dead_letters") == 1
    for host in (f"127.0.0.1:{console}", f"localhost:{console}", f"[::1]:{console}", "console.internal"):
        status, _, page = _request(console, f"/event/{event_id}", host=host)
        assert status == 200 and "orders.secret" in page, host


def test_every_response_forbids_framing_sniffing_and_storing(schema: str, console: int) -> None:
    for path in (
        "/",
        "/dead",
        f"/event/{uuid.uuid4()}",
        "/replay",
        "/audit",
        "/static/console.js",
        "/nowhere",
    ):
        _, headers, _ = _request(console, path)
        assert headers["x-frame-options"] == "DENY", path
        assert "frame-ancestors 'none'" in headers["content-security-policy"], path
        assert "script-src 'self'" in headers["content-security-policy"], path
        assert headers["x-content-type-options"] == "nosniff", path
        assert headers["cache-control"] == "no-store", path


def test_a_replay_waiting_on_the_database_holds_up_no_other_page(
    pg_dsn: str, schema: str, console: int
) -> None:
    """Database work runs off the event loop: with a replay's audit row waiting behind a lock,
    the overview and the audit page still answer. On the loop, every page waited for the lock."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.delivered (id, event_id, topic, key, payload, headers, created_at, delivered_at, "
                "attempts) VALUES (1, gen_random_uuid(), 'orders', 'k', 'x', '{{}}', now(), now() - interval '5 min', 1)"
            ).format(sql.Identifier(schema))
        )
    _, _, page = _request(
        console, "/replay/preview", method="POST", body="since=1h", Sec_Fetch_Site="same-origin",
        Content_Type="application/x-www-form-urlencoded",
    )  # fmt: skip
    form = urllib.parse.urlencode(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', page))
    holder = psycopg.connect(pg_dsn)
    holder.execute(sql.SQL("LOCK TABLE {}.audit IN SHARE ROW EXCLUSIVE MODE").format(sql.Identifier(schema)))
    replayed: list[int] = []
    replay = threading.Thread(
        target=lambda: replayed.append(
            _request(
                console,
                "/replay/act",
                method="POST",
                body=form,
                Sec_Fetch_Site="same-origin",
                Content_Type="application/x-www-form-urlencoded",
            )[0]
        )
    )
    try:
        replay.start()
        wait_for(lambda: _waiting_on_audit(pg_dsn), timeout=30, what="the replay waiting on the lock")
        started = time.monotonic()
        assert _request(console, "/")[0] == 200
        assert _request(console, "/audit")[0] == 200
        assert time.monotonic() - started < 20, "the pages waited for the replay"
        assert replay.is_alive(), "the replay did not wait"
    finally:
        holder.close()
        replay.join(30)
    assert replayed == [303] and count(pg_dsn, schema, "events") == 1


def _waiting_on_audit(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'outbox-console' "
            "AND wait_event_type = 'Lock'"
        ).fetchone()
    return bool(row and row[0])


def _forwarded_redrive(pg_dsn: str, schema: str, port: int, dead_id: int) -> str:
    """Redrive dead letter ``dead_id`` in a POST that names another client in X-Forwarded-For;
    the audit trail's actor for it."""
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, attempts, "
                "error, first_failed_at, failed_at, parked) VALUES (%s, gen_random_uuid(), 'orders', 'k', 'x', "
                "'{{}}', now(), 1, 'boom', now(), now(), true)"
            ).format(sql.Identifier(schema)),
            (dead_id,),
        )
    status, _, _ = _request(
        port, "/dead/act", method="POST", body=f"action=redrive&hw={dead_id}&id={dead_id}",
        Sec_Fetch_Site="same-origin", Content_Type="application/x-www-form-urlencoded",
        X_Forwarded_For="10.9.8.7", X_Forwarded_Proto="https",
    )  # fmt: skip
    assert status == 303, status
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT actor FROM {}.audit ORDER BY id DESC LIMIT 1").format(sql.Identifier(schema))
        ).fetchone()
    assert row is not None
    return str(row[0])


def test_a_forwarding_header_names_nobody_unless_it_comes_from_a_proxy_the_operator_named(
    pg_dsn: str, schema: str, console: int
) -> None:
    """uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local client (another user
    of the machine, a sidecar) could write whom it liked into the audit trail as the actor. The
    console believes no forwarding header unless --forwarded-allow-ips names the proxy."""
    assert _forwarded_redrive(pg_dsn, schema, console, 1) == "127.0.0.1 (console)"
    port = free_port()
    with ModuleProcess(
        "outbox", "console", "--dsn", pg_dsn, "--schema", schema, "--port", str(port),
        "--forwarded-allow-ips", "127.0.0.1",
    ) as proxied:  # fmt: skip
        wait_for(lambda: _status(port, "/") == 200, timeout=30, what=f"the console\n{proxied.output()}")
        assert _forwarded_redrive(pg_dsn, schema, port, 2) == "10.9.8.7 (console)"
