"""The operator console through Starlette's test client, against the real PostgreSQL: its counts
(against `outbox status`), filters, previews, high-water marks, guards (read-only, CSRF, basic
auth), escaping, the audit rows, and a mount under a prefix."""

from __future__ import annotations

import base64
import datetime as dt
import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.testclient import TestClient

import outbox
from outbox.console import app
from outbox.operate import status
from tests.helpers import count

SAME = {"sec-fetch-site": "same-origin"}


def _dead(dsn: str, schema: str, rows: list[tuple[int, str, str, str, bool]]) -> None:
    """Dead letters (id, topic, key, error, parked), failed an hour ago."""
    with psycopg.connect(dsn) as conn:
        for i, topic, key, error, parked in rows:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, "
                    "attempts, error, first_failed_at, failed_at, parked) VALUES (%s, gen_random_uuid(), %s, "
                    "%s, %s, '{{}}', now(), 10, %s, now() - interval '1 hour', now() - interval '1 hour', %s)"
                ).format(sql.Identifier(schema)),
                (i, topic, key.encode(), b'{"dead": true}', error, parked),
            )


def _client(dsn: str, schema: str, **options: Any) -> TestClient:
    return TestClient(app(dsn, schema=schema, **options), base_url="http://localhost:8000")


@pytest.fixture
def client(pg_dsn: str, schema: str) -> Iterator[TestClient]:
    with _client(pg_dsn, schema) as c:
        yield c


def _hw(page: str) -> int:
    m = re.search(r'name="hw" value="(\d+)"', page)
    assert m, "no high-water mark on the page"
    return int(m.group(1))


def test_overview_counts_are_status_counts_and_refresh_in_place(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn,
            [{"topic": "orders", "payload": {"i": i}, "key": f"k{i % 3}"} for i in range(7)],
            schema=schema,
        )
        outbox.enqueue_many(
            conn, [{"topic": "invoices", "payload": {"i": i}} for i in range(2)], schema=schema
        )
        conn.execute(
            sql.SQL("UPDATE {}.events SET attempts = 2, last_error = 'x' WHERE topic = 'invoices'").format(
                sql.Identifier(schema)
            )
        )
    _dead(pg_dsn, schema, [(1, "orders", "k9", "boom", True), (2, "payments", "p1", "no", False)])
    page = client.get("/")
    assert page.status_code == 200 and "<html" in page.text
    with psycopg.connect(pg_dsn) as conn:
        report = status.collect(conn, schema)
    rows = dict(re.findall(r'<tr data-topic="([^"]+)">(.*?)</tr>', page.text, re.S))
    cells = {
        t: re.findall(r'<td class="n">(?:<a [^>]*>)?(\d+|–|[\d.]+ \w+)', body) for t, body in rows.items()
    }
    assert cells["orders"][:4] == ["7", "0", "1", "1"]
    assert cells["invoices"][:4] == ["0", "2", "0", "0"]
    assert cells["payments"][:4] == ["0", "0", "1", "0"]
    assert report["pending"] == 9 and report["retrying"] == 2 and report["dead"] == 2
    assert f'id="total-pending">{report["pending"] - report["retrying"]}<' in page.text
    live = client.get("/", headers={"hx-request": "true"})
    assert live.status_code == 200 and "<html" not in live.text and 'data-topic="orders"' in live.text
    assert "No live relay" in live.text
    chart = client.get("/chart.json").json()
    assert len(chart["x"]) == 60 and chart["series"] == {}


def test_a_big_events_table_is_estimated_from_a_sample_and_says_so(
    pg_dsn: str, schema: str, client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past EXACT_ROWS (the planner's estimate) the overview counts pending and retrying on a
    sample of the events table's pages instead of scanning it, marks them "≈", and keeps the
    ages exact. Here the limit is lowered so that 3,000 rows count as big; the sample then
    covers the whole table, so the estimate must equal the truth."""
    from outbox.console import data

    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn,
            [
                {"topic": "orders" if i % 3 else "invoices", "payload": {"i": i}, "key": f"k{i}"}
                for i in range(3000)
            ],
            schema=schema,
        )
        conn.execute(
            sql.SQL("UPDATE {}.events SET attempts = 1 WHERE id % 10 = 0").format(sql.Identifier(schema))
        )
        conn.commit()
        conn.execute(sql.SQL("ANALYZE {}.events").format(sql.Identifier(schema)))
        conn.commit()
    small = client.get("/", headers={"hx-request": "true"}).text
    assert "≈" not in small and 'id="estimated"' not in small
    monkeypatch.setattr(data, "EXACT_ROWS", 100)
    with psycopg.connect(pg_dsn) as conn:
        view = data.overview(conn, schema)
        exact = {
            t: (int(p), int(r))
            for t, p, r in conn.execute(
                sql.SQL(
                    "SELECT topic, count(*) FILTER (WHERE attempts = 0), count(*) FILTER (WHERE attempts > 0) "
                    "FROM {}.events GROUP BY topic"
                ).format(sql.Identifier(schema))
            )
        }
    assert view["estimated"]["events"] and view["estimated"]["events_rows"] == 3000
    assert {t["topic"]: (t["pending"], t["retrying"]) for t in view["topics"]} == exact
    assert all(t["oldest_age_seconds"] is not None for t in view["topics"])
    page = client.get("/", headers={"hx-request": "true"}).text
    assert 'id="estimated"' in page and f'id="total-pending">≈ {sum(p for p, _ in exact.values())}<' in page


def test_dead_letters_group_by_fingerprint_and_filter(pg_dsn: str, schema: str, client: TestClient) -> None:
    _dead(pg_dsn, schema, [
        (10, "orders", "k1", "MSG_SIZE_TOO_LARGE: message of 1200345 bytes > 1048576", True),
        (11, "orders", "k2", "MSG_SIZE_TOO_LARGE: message of 2000000 bytes > 1048576", True),
        (12, "orders", "k3", "TOPIC_AUTHORIZATION_FAILED: denied for 5f0c2a4e-1b1e-4c3a-9d4e-2b7e8c9d0a1b", False),
        (13, "payments", "k1", "MSG_SIZE_TOO_LARGE: message of 3 bytes > 1048576", True),
    ])  # fmt: skip
    page = client.get("/dead").text
    groups = re.findall(r'<td class="reason">([^<]*)</td><td class="n"><a href="[^"]*">(\d+)</a></td>', page)
    assert ("MSG_SIZE_TOO_LARGE: message of &lt;n&gt; bytes &gt; &lt;n&gt;", "2") in groups
    assert ("TOPIC_AUTHORIZATION_FAILED: denied for &lt;id&gt;", "1") in groups
    assert len(groups) == 3  # orders x 2 fingerprints, payments x 1
    assert len(re.findall(r'class="reason"', client.get("/dead", params={"topic": "payments"}).text)) == 1
    assert "denied" in client.get("/dead", params={"error": "DENIED"}).text
    assert "denied" not in client.get("/dead", params={"key": "k1"}).text
    later = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=5)).isoformat()
    assert "No dead letter matches" in client.get("/dead", params={"since": later}).text
    assert client.get("/dead", params={"since": "yesterday"}).status_code == 400
    with psycopg.connect(pg_dsn) as conn:
        event_id = conn.execute(
            sql.SQL("SELECT event_id FROM {}.dead_letters WHERE id = 12").format(sql.Identifier(schema))
        ).fetchone()[0]
    found = client.get("/dead", params={"event_id": str(event_id)}, follow_redirects=True)
    assert (
        found.status_code == 200
        and f"Event <code>{event_id}</code>" in found.text
        and "dead since" in found.text
    )


def test_preview_then_act_touches_only_what_the_page_showed(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    _dead(pg_dsn, schema, [(100, "orders", "a", "boom 1", True), (200, "orders", "b", "boom 2", True)])
    with psycopg.connect(pg_dsn) as conn:  # parked behind them: 3 events of a, 2 of b (ids > 200)
        conn.execute(
            sql.SQL("SELECT setval(pg_get_serial_sequence('{}.events', 'id'), 1000)").format(
                sql.Identifier(schema)
            )
        )
        outbox.enqueue_many(
            conn,
            [{"topic": "orders", "payload": "x", "key": k} for k in "aaabb"]
            + [{"topic": "orders", "payload": "y", "key": "c"}],
            schema=schema,
        )
    page = client.get("/dead", params={"topic": "orders"}).text
    hw = _hw(page)
    assert hw == 2  # the second dead letter made (seq), whatever its event's id
    form = {"action": "redrive", "hw": str(hw), "topic": "orders", "fingerprint": "boom <n>"}
    preview = client.post("/dead/preview", data=form, headers=SAME)
    assert preview.status_code == 200, preview.text
    assert (
        "<b>2</b> dead letters over <b>2</b> keys" in preview.text
        and "<b>5</b> parked events" in preview.text
    )
    assert "outbox dead redrive --topic orders" in preview.text
    _dead(pg_dsn, schema, [(300, "orders", "d", "boom 3", True)])  # arrives after the page loaded
    done = client.post("/dead/act", data=form, headers=SAME, follow_redirects=False)
    assert done.status_code == 303
    assert client.get(done.headers["location"]).status_code == 200
    with psycopg.connect(pg_dsn) as conn:
        left = [
            r[0]
            for r in conn.execute(
                sql.SQL("SELECT id FROM {}.dead_letters ORDER BY id").format(sql.Identifier(schema))
            )
        ]
        trail = conn.execute(
            sql.SQL("SELECT via, action, actor, planned, done, selector FROM {}.audit").format(
                sql.Identifier(schema)
            )
        ).fetchall()
    assert left == [300], "the dead letter that came after the page was swept up"
    assert count(pg_dsn, schema, "events", "attempts = 0 AND id IN (100, 200)") == 2
    [(via, action, actor, planned, n, selector)] = trail
    assert (via, action, planned, n) == ("console", "redrive", 2, 2) and "(console)" in actor
    assert selector == {"topic": "orders", "fingerprint": "boom <n>", "high_water": 2}
    audit_page = client.get("/audit").text
    assert "console" in audit_page and "outbox dead redrive --topic orders" in audit_page


def test_skip_one_event_from_its_page(pg_dsn: str, schema: str, client: TestClient) -> None:
    _dead(pg_dsn, schema, [(5, "orders", "a", "boom", True), (6, "orders", "a", "boom", False)])
    form = {"action": "skip", "hw": "6", "id": "5"}
    preview = client.post("/dead/preview", data=form, headers=SAME)
    assert "<b>1</b> dead letters over <b>1</b> keys" in preview.text
    assert client.post("/dead/act", data=form, headers=SAME, follow_redirects=False).status_code == 303
    assert count(pg_dsn, schema, "dead_letters", "parked") == 0
    assert count(pg_dsn, schema, "dead_letters") == 2  # skipped: kept as dead letters, unparked


def test_read_only_refuses_every_post_and_offers_no_action(pg_dsn: str, schema: str) -> None:
    _dead(pg_dsn, schema, [(1, "orders", "a", "boom", True)])
    form = {"action": "redrive", "hw": "1", "id": "1"}
    with _client(pg_dsn, schema, read_only=True) as c:
        for path in ("/dead", "/key?key=a"):
            page = c.get(path).text
            assert "redrive" not in page.lower().replace("redrive or skip", ""), path
            assert 'method="post"' not in page
        assert c.post("/dead/preview", data=form, headers=SAME).status_code == 403
        assert c.post("/dead/act", data=form, headers=SAME).status_code == 403
    with _client(pg_dsn, schema, authorize=lambda r: "read") as c:
        assert c.post("/dead/act", data=form, headers=SAME).status_code == 403
    with _client(pg_dsn, schema, authorize=lambda r: None) as c:
        assert c.get("/").status_code == 401
    assert count(pg_dsn, schema, "dead_letters") == 1


def test_cross_site_posts_are_refused(pg_dsn: str, schema: str, client: TestClient) -> None:
    _dead(pg_dsn, schema, [(1, "orders", "a", "boom", True)])
    form = {"action": "redrive", "hw": "1", "id": "1"}
    for headers in (
        {"sec-fetch-site": "cross-site"},
        {"sec-fetch-site": "same-site"},
        {"origin": "https://evil.example"},
        {"origin": "null"},
    ):
        assert client.post("/dead/act", data=form, headers=headers).status_code == 403, headers
    assert count(pg_dsn, schema, "dead_letters") == 1
    ok = client.post(
        "/dead/act", data=form, headers={"origin": "http://localhost:8000"}, follow_redirects=False
    )
    assert ok.status_code == 303
    assert count(pg_dsn, schema, "dead_letters") == 0
    assert client.get("/dead/act").status_code == 405  # no GET changes anything


def test_basic_auth(pg_dsn: str, schema: str) -> None:
    from outbox.console.web import basic_auth

    with _client(pg_dsn, schema, authorize=basic_auth("ops", "s3cret")) as c:
        refused = c.get("/")
        assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
        bad = base64.b64encode(b"ops:wrong").decode()
        assert c.get("/", headers={"authorization": f"Basic {bad}"}).status_code == 401
        good = base64.b64encode(b"ops:s3cret").decode()
        assert c.get("/", headers={"authorization": f"Basic {good}"}).status_code == 200


def test_everything_shown_is_escaped_and_no_password_shows(pg_dsn: str, schema: str) -> None:
    evil = "<script>alert(1)</script>"
    with psycopg.connect(pg_dsn) as conn:
        event_id = outbox.enqueue(conn, evil, evil, key=evil, headers={"x-evil": evil}, schema=schema)
    _dead(pg_dsn, schema, [(1, evil, evil, evil, True)])
    dsn = pg_dsn + " password=hunter2-secret"
    with _client(dsn, schema) as c:
        pages = [
            c.get(p, params=q).text
            for p, q in (
                ("/", {}),
                ("/dead", {}),
                ("/key", {"key": evil}),
                (f"/event/{event_id}", {}),
                ("/audit", {}),
            )
        ]
    for page in pages:
        assert "<script>alert" not in page
        assert "hunter2-secret" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in pages[3]


def test_key_timeline_in_order_with_coordinates_and_parking(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.delivered (id, event_id, topic, key, payload, headers, created_at, delivered_at, "
                "attempts, sink_partition, sink_offset) VALUES (1, gen_random_uuid(), 'orders', 'c-7', 'x', '{{}}', "
                "now() - interval '2 min', now() - interval '1 min', 1, 3, 41)"
            ).format(sql.Identifier(schema))
        )
        conn.commit()
    _dead(pg_dsn, schema, [(2, "orders", "c-7", "MSG_SIZE_TOO_LARGE: too big", True)])
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL("SELECT setval(pg_get_serial_sequence('{}.events', 'id'), 10)").format(
                sql.Identifier(schema)
            )
        )
        outbox.enqueue_many(
            conn, [{"topic": "orders", "payload": str(i), "key": "c-7"} for i in range(2)], schema=schema
        )
    page = client.get("/key", params={"key": "c-7"}).text
    states = re.findall(r'<tr class="([a-z ]+)"><td>(\d+)</td>', page)
    assert states == [("delivered", "1"), ("dead", "2"), ("pending parked", "11"), ("pending parked", "12")]
    assert "partition 3 offset 41" in page
    assert "dead letter 2 holds back 2 later events" in page
    assert "No event of this key" in client.get("/key", params={"key": "nobody"}).text


def test_an_archived_event_is_found_through_its_key_or_a_scan_on_request(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    """The archive has no index on event ids (migration 0011): an event id alone finds pending
    and dead events and offers the archive through the key, or a scan asked for by name."""
    event_id = uuid.uuid4()
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.delivered (id, event_id, topic, key, payload, headers, created_at, "
                "delivered_at, attempts, sink_partition, sink_offset) VALUES (5, %s, 'orders', 'c-7', "
                "'{{}}', '{{}}', now(), now(), 1, 2, 77)"
            ).format(sql.Identifier(schema)),
            (event_id,),
        )
    alone = client.get(f"/event/{event_id}")
    assert alone.status_code == 404 and 'id="archive-search"' in alone.text
    assert "Not pending and not a dead letter." in alone.text
    by_key = client.get(f"/event/{event_id}", params={"key": "c-7"})
    assert by_key.status_code == 200 and "partition 2" in by_key.text and "offset 77" in by_key.text
    assert 'id="archive-search"' not in by_key.text
    assert client.get(f"/event/{event_id}", params={"key": "other"}).status_code == 404
    scanned = client.get(f"/event/{event_id}", params={"archive": "scan"})
    assert scanned.status_code == 200 and "offset 77" in scanned.text
    # The header's search box takes the key along; the timeline links carry it.
    found = client.get("/dead", params={"event_id": str(event_id), "key": "c-7"}, follow_redirects=False)
    assert found.headers["location"].endswith(f"/event/{event_id}?key=c-7")
    timeline = client.get("/key", params={"key": "c-7"}).text
    assert f"/event/{event_id}?key=c-7" in timeline


def test_event_page_pretty_json_hidden_payload_and_trace_link(pg_dsn: str, schema: str) -> None:
    trace = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    with psycopg.connect(pg_dsn) as conn:
        event_id = outbox.enqueue(
            conn, "orders", {"id": 42, "sku": "a-1"}, key="c-7", headers={"traceparent": trace}, schema=schema
        )
    with _client(pg_dsn, schema, trace_url="https://jaeger.example/trace/{trace_id}") as c:
        page = c.get(f"/event/{event_id}").text
        assert '"id": 42,\n  "sku": "a-1"' in page.replace("&#34;", '"')
        assert 'href="https://jaeger.example/trace/4bf92f3577b34da6a3ce929d0e0e4736"' in page
        assert c.get(f"/event/{uuid.uuid4()}").status_code == 404
        assert c.get("/event/not-a-uuid").status_code == 400
    with _client(pg_dsn, schema, hide_payloads=True) as c:
        assert "<details><summary>show the payload</summary>" in c.get(f"/event/{event_id}").text


def test_mounted_under_a_prefix_every_link_keeps_it(pg_dsn: str, schema: str) -> None:
    _dead(pg_dsn, schema, [(1, "orders", "a", "boom", True)])
    host = Starlette(
        routes=[Mount("/ops/outbox", app=app(pg_dsn, schema=schema, allowed_hosts=["shop.test"]))]
    )
    with TestClient(host, base_url="http://shop.test") as c:
        page = c.get("/ops/outbox/dead")
        assert page.status_code == 200
        links = re.findall(r'(?:href|src|action)="([^"]+)"', page.text)
        local = [u for u in links if not u.startswith("https://")]
        assert local and all(u.startswith(("http://shop.test/ops/outbox/", "/ops/outbox/")) for u in local), (
            local
        )
        assert c.get("/ops/outbox/static/vendor/htmx-2.0.11/htmx.min.js").status_code == 200
        form = {"action": "redrive", "hw": "1", "id": "1"}
        done = c.post("/ops/outbox/dead/act", data=form, headers=SAME, follow_redirects=False)
        assert done.status_code == 303 and "/ops/outbox/dead" in done.headers["location"]


def test_the_cli_refuses_a_public_address_without_a_password(pg_dsn: str, schema: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "outbox", "console", "--dsn", pg_dsn, "--schema", schema, "--host", "0.0.0.0"],
        capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "OUTBOX_CONSOLE_PASSWORD" in out.stderr and "loopback" in out.stderr
    json.dumps(out.stderr)


def test_replay_a_window_with_a_preview_that_fixes_its_end(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        for i in range(3):
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.delivered (id, event_id, topic, key, payload, headers, created_at, delivered_at, "
                    "attempts) VALUES (%s, gen_random_uuid(), 'orders', 'k', %s, '{{}}', now(), now() - interval '10 min', 1)"
                ).format(sql.Identifier(schema)),
                (i + 1, f"e{i}".encode()),
            )
    preview = client.post("/replay/preview", data={"since": "1h", "topic": "orders"}, headers=SAME)
    assert preview.status_code == 200 and "<b>3</b> archived events" in preview.text
    assert "outbox replay --since " in preview.text and "--topic orders" in preview.text
    form = dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', preview.text))
    with psycopg.connect(pg_dsn) as conn:  # delivered after the preview: not in what it showed
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.delivered (id, event_id, topic, key, payload, headers, created_at, delivered_at, "
                "attempts) VALUES (9, gen_random_uuid(), 'orders', 'k', 'late', '{{}}', now(), now(), 1)"
            ).format(sql.Identifier(schema))
        )
    done = client.post("/replay/act", data=form, headers=SAME, follow_redirects=False)
    assert done.status_code == 303
    assert "replay: 3 events queued again" in client.get(done.headers["location"]).text
    assert count(pg_dsn, schema, "events") == 3
    assert client.post("/replay/preview", data={"since": "soon"}, headers=SAME).status_code == 400
    assert (
        client.post("/replay/preview", data={"since": "1h", "until": "2h"}, headers=SAME).status_code == 400
    )
    with psycopg.connect(pg_dsn) as conn:
        [(via, action, planned, n)] = conn.execute(
            sql.SQL("SELECT via, action, planned, done FROM {}.audit").format(sql.Identifier(schema))
        ).fetchall()
    assert (via, action, planned, n) == ("console", "replay", 3, 3)


def test_bad_input_is_a_400_naming_the_field(client: TestClient) -> None:
    for path, params in (
        ("/dead", {"key": "0xzz"}),
        ("/key", {"key": "0xnothex"}),
        ("/dead", {"since": "never"}),
    ):
        out = client.get(path, params=params)
        assert out.status_code == 400 and out.text.split(":")[0] in ("key", "since"), (path, out.text)


def test_each_relay_records_its_readiness_for_status_and_the_console(
    pg_dsn: str, schema: str, kafka: str, client: TestClient
) -> None:
    from outbox.harness.embedded import free_port
    from outbox.relay.config import RelayConfig
    from outbox.sinks.kafka import KafkaSink
    from tests.helpers import running_relay, wait_for

    def readiness() -> list[str | None]:
        with psycopg.connect(pg_dsn) as conn:
            return [r["readiness"] for r in status.collect(conn, schema)["relays"]]

    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1)
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: readiness() == ["ready"], timeout=30, what="a ready relay recorded")
        assert '<span class="ok">ready</span>' in client.get("/").text
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens: the sink is down
    with running_relay(config, lambda: KafkaSink(nowhere, delivery_timeout=config.delivery_timeout)):
        wait_for(lambda: "sink down" in readiness(), timeout=30, what="a relay whose sink is down")
        assert '<span class="warn">sink down</span>' in client.get("/").text


def test_a_group_opened_lists_its_dead_letters_and_acts_on_a_selection(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    _dead(pg_dsn, schema, [(i, "orders", f"k{i}", f"boom {i}", True) for i in range(1, 6)])
    _dead(pg_dsn, schema, [(9, "orders", "k9", "other", True)])
    page = client.get("/dead").text
    link = re.search(r'<a href="([^"]*/dead/list\?[^"]*fingerprint=boom[^"]*)">5</a>', page)
    assert link, page
    listed = client.get(link.group(1).replace("&amp;", "&")).text
    assert re.findall(r'name="id" value="(\d+)"', listed) == ["1", "2", "3", "4", "5"]
    form = {"action": "skip", "hw": "9", "id": ["2", "4"]}
    preview = client.post("/dead/preview", data=form, headers=SAME)
    assert "<b>2</b> dead letters over <b>2</b> keys" in preview.text
    assert client.post("/dead/act", data=form, headers=SAME, follow_redirects=False).status_code == 303
    with psycopg.connect(pg_dsn) as conn:
        unparked = [
            r[0]
            for r in conn.execute(
                sql.SQL("SELECT id FROM {}.dead_letters WHERE NOT parked ORDER BY id").format(
                    sql.Identifier(schema)
                )
            )
        ]
    assert unparked == [2, 4]


def test_a_keys_pending_events_are_found_through_the_key_index(pg_dsn: str, schema: str) -> None:
    """The key timeline and the redrive preview find a key's pending events through
    events (key, id) (migration 0012), not by reading the events table: at a million pending
    events that read was 250-400 ms (docs/console.md, "Speed"). Sequential scans are switched
    off, so a small table does not hide the plan the planner would choose at size."""
    from outbox.store.queries import query

    with psycopg.connect(pg_dsn) as conn:
        conn.execute("SET enable_seqscan = off")
        plans = {}
        for name, params in (
            ("console_key_pending", {"key": b"k", "limit": 200}),
            ("console_preview", {"ids": "{1,2}"}),
        ):
            explain = sql.SQL("EXPLAIN ") + query(name, schema)
            plans[name] = "\n".join(r[0] for r in conn.execute(explain, params).fetchall())
    for name, plan in plans.items():
        assert "events_key_idx" in plan, f"{name}:\n{plan}"


def test_the_overview_shows_the_latest_verification_and_links_what_a_sink_lost(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    assert "Never verified" in client.get("/").text
    lost = "0b7e5b7c-6b5e-4a55-9a41-2d8f0c1f1e11"
    with psycopg.connect(pg_dsn) as conn:
        for missing, ids in ((0, "{}"), (1, "{" + lost + "}")):  # the latest one is shown
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.verifications (via, since, until, checked, present, missing, expired, "
                    "unverifiable, missing_ids) VALUES ('relay', now() - interval '1 hour', now(), 40, 36, %s, "
                    "2, 1, %s::uuid[])"
                ).format(sql.Identifier(schema)),
                (missing, ids),
            )
    page = client.get("/", headers={"hx-request": "true"}).text
    table = re.search(r'<table class="grid" id="verification">(.*?)</table>', page, re.S)
    assert table is not None and "by the relay, over 1.0 h of deliveries" in table.group(1)
    cells = re.findall(r'<td class="n(?: warn)?">(\d+)</td>', table.group(1))
    assert cells == ["40", "36", "1", "2", "1"]
    assert f'href="http://localhost:8000/event/{lost}">{lost}</a>' in page and "--repair" in page
