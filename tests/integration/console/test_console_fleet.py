"""The console over several outboxes, through Starlette's test client against the real PostgreSQL:
the fleet page (its counts, sorting, filtering, limits), each outbox's pages under its name, an
action in one outbox that changes nothing in another, the fleet's audit."""

from __future__ import annotations

import re
from collections.abc import Iterator

import psycopg
import pytest
from psycopg import sql
from starlette.testclient import TestClient

import outbox
from outbox.console import app
from outbox.relay.limits import gates, parse_limit, take
from outbox.store.membership import Membership
from outbox.store.migrate import migrate
from outbox.store.outboxes import Outbox
from outbox.store.sessions import Link
from tests.helpers import count
from tests.integration.console.test_console import SAME, _dead, _hw


@pytest.fixture
def boxes(pg_dsn: str, prefix: str) -> list[Outbox]:
    out = []
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for name in ("alpha", "beta", "gamma"):
            migrate(conn, f"{prefix}_{name}")
            out.append(Outbox(name, pg_dsn, f"{prefix}_{name}"))
    return out


@pytest.fixture
def client(boxes: list[Outbox]) -> Iterator[TestClient]:
    with TestClient(app(outboxes=boxes), base_url="http://localhost:8000") as c:
        yield c


def _fleet_rows(page: str) -> dict[str, list[str]]:
    rows = re.findall(r'<tr data-outbox="([^"]+)">(.*?)</tr>', page, re.S)
    return {name: re.findall(r'<td class="n[^"]*">([^<]*)<', body) for name, body in rows}


def test_the_fleet_page_counts_each_outbox_sorts_and_filters(
    pg_dsn: str, boxes: list[Outbox], client: TestClient
) -> None:
    alpha, beta, gamma = boxes
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue_many(
            conn, [{"topic": "t", "payload": {"i": i}} for i in range(5)], schema=alpha.schema
        )
        outbox.enqueue_many(conn, [{"topic": "t", "payload": {"i": i}} for i in range(2)], schema=beta.schema)
    _dead(pg_dsn, gamma.schema, [(1, "t", "k", "boom", True), (2, "t", "j", "no", False)])
    page = client.get("/")
    assert page.status_code == 200
    rows = _fleet_rows(page.text)
    assert list(rows) == ["alpha", "beta", "gamma"]  # by pending, most first
    assert [rows[n][0] for n in rows] == ["5", "2", "0"]
    assert rows["gamma"][3:5] == ["2", "1"]  # dead letters, parked keys
    by_dead = _fleet_rows(client.get("/", params={"sort": "dead", "order": "desc"}).text)
    assert next(iter(by_dead)) == "gamma"
    by_name = _fleet_rows(client.get("/", params={"sort": "name", "order": "desc"}).text)
    assert list(by_name) == ["gamma", "beta", "alpha"]
    assert list(_fleet_rows(client.get("/", params={"find": "ET"}).text)) == ["beta"]
    assert client.get("/", params={"sort": "nonsense"}).status_code == 200  # an unknown sort: the default


def test_the_fleet_page_shows_each_outboxs_limits(
    pg_dsn: str, boxes: list[Outbox], client: TestClient
) -> None:
    """A limit the relays of an outbox apply shows on its row (written where relays take tokens)."""
    member = Membership(Link(lambda: psycopg.connect(pg_dsn)), name="r", lease=10.0, batch_lease=30.0)
    (gate,) = gates([parse_limit("partner.*=50/s,in_flight=8")])
    member.beat([], [], "ready")
    try:
        assert take(member.link.get(), member.id, boxes[1].schema, gate, 3)[0] == 3
    finally:
        member.link.close()
    rows = re.findall(r'<tr data-outbox="([^"]+)">(.*?)</tr>', client.get("/").text, re.S)
    shown = dict(rows)
    assert "partner.*=50/s,in_flight=8" in shown["beta"] and "3 in flight" in shown["beta"]
    assert "partner" not in shown["alpha"]


def test_each_outbox_has_its_pages_under_its_name_and_links_stay_there(
    pg_dsn: str, boxes: list[Outbox], client: TestClient
) -> None:
    page = client.get("/o/beta/")
    assert page.status_code == 200
    assert 'id="outbox-name">beta<' in page.text and boxes[1].schema in page.text
    assert '/o/beta/dead"' in page.text and 'id="fleet-link"' in page.text
    assert 'href="/"' in page.text  # the way back to the fleet page
    assert client.get("/o/beta/dead").status_code == 200
    assert client.get("/o/beta", follow_redirects=False).status_code == 307
    assert client.get("/o/nobody/").status_code == 404
    assert client.get("/o/beta/static/console.css").status_code == 200


def test_an_action_in_one_outbox_changes_nothing_in_another_and_the_audit_says_where(
    pg_dsn: str, boxes: list[Outbox], client: TestClient
) -> None:
    alpha, beta, _ = boxes
    for o in (alpha, beta):  # the same dead letters in both: the same ids, topic and key
        _dead(pg_dsn, o.schema, [(1, "orders", "k", "boom", True), (2, "orders", "j", "boom", True)])
    hw = _hw(client.get("/o/alpha/dead", params={"topic": "orders"}).text)
    form = {"action": "redrive", "hw": str(hw), "topic": "orders"}
    preview = client.post("/o/alpha/dead/preview", data=form, headers=SAME)
    assert preview.status_code == 200 and "<b>2</b> dead letters" in preview.text
    done = client.post("/o/alpha/dead/act", data=form, headers=SAME, follow_redirects=False)
    assert done.status_code == 303 and done.headers["location"].startswith(
        "http://localhost:8000/o/alpha/dead"
    )
    assert count(pg_dsn, alpha.schema, "dead_letters") == 0 and count(pg_dsn, alpha.schema, "events") == 2
    assert count(pg_dsn, beta.schema, "dead_letters") == 2 and count(pg_dsn, beta.schema, "events") == 0
    assert count(pg_dsn, beta.schema, "audit") == 0
    assert "outbox dead redrive --topic orders" in client.get("/o/alpha/audit").text
    assert "No action recorded yet" in client.get("/o/beta/audit").text
    fleet_audit = client.get("/audit").text
    assert re.findall(r'<tr data-outbox="([^"]+)">', fleet_audit) == ["alpha"]
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(sql.SQL("SELECT action FROM {}.audit").format(sql.Identifier(alpha.schema)))
        assert [r[0] for r in rows] == ["redrive"]


def test_a_console_over_outboxes_is_given_outboxes_or_a_dsn_not_both(boxes: list[Outbox]) -> None:
    with pytest.raises(TypeError):
        app(boxes[0].dsn, outboxes=boxes)
    with pytest.raises(TypeError):
        app()
