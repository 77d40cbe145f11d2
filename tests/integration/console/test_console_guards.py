"""The console's actions do only what their page showed, and say who did them: each abuse
mounted through the application (Starlette's test client) on the real PostgreSQL, and the
command lines it shows run for real. The attacks over real HTTP are in
tests/acceptance/test_console_http.py."""

from __future__ import annotations

import base64
import datetime as dt
import os
import re
import shlex
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import errors, sql
from starlette.testclient import TestClient

import outbox
from outbox.console import app
from tests.helpers import count, login_in

SAME = {"sec-fetch-site": "same-origin"}


def _client(dsn: str, schema: str, **options: Any) -> TestClient:
    return TestClient(app(dsn, schema=schema, **options), base_url="http://localhost:8000")


@pytest.fixture
def client(pg_dsn: str, schema: str) -> Iterator[TestClient]:
    with _client(pg_dsn, schema) as c:
        yield c


def _dead(dsn: str, schema: str, rows: list[tuple[int, str, str, str, str]]) -> None:
    """Dead letters (id, topic, key, error, failed how long ago), parked, made in this order."""
    with psycopg.connect(dsn) as conn:
        for i, topic, key, error, ago in rows:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, "
                    "attempts, error, first_failed_at, failed_at, parked) VALUES (%s, gen_random_uuid(), %s, "
                    "%s, 'p', '{{}}', now(), 10, %s, now(), now() - %s::interval, true)"
                ).format(sql.Identifier(schema)),
                (i, topic, key.encode(), error, ago),
            )


def _archived(dsn: str, schema: str, ids: list[int], ago: str = "10 min") -> None:
    with psycopg.connect(dsn) as conn:
        for i in ids:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.delivered (id, event_id, topic, key, payload, headers, created_at, "
                    "delivered_at, attempts) VALUES (%s, gen_random_uuid(), 'orders', 'k', %s, '{{}}', now(), "
                    "now() - %s::interval, 1)"
                ).format(sql.Identifier(schema)),
                (i, f"e{i}".encode(), ago),
            )


def _hidden(page: str) -> dict[str, str]:
    return dict(re.findall(r'<input type="hidden" name="(\w+)" value="([^"]*)">', page))


def _ids(dsn: str, schema: str, table: str) -> list[int]:
    with psycopg.connect(dsn) as conn:
        return [
            int(r[0])
            for r in conn.execute(
                sql.SQL("SELECT id FROM {}.{} ORDER BY id").format(
                    sql.Identifier(schema), sql.Identifier(table)
                )
            )
        ]


# -- replay ------------------------------------------------------------------------------------


def test_a_replay_never_reaches_past_its_preview(pg_dsn: str, schema: str, client: TestClient) -> None:
    """An open window (until in the future) would take in the replay's own fresh copies as they are
    delivered; refused. The action replays what its preview counted: archived events up to the
    preview's highest id (copies delivered since, inside the window, are not re-sent), and only
    as many as it counted (one purged since: refused, nothing replayed)."""
    future = (dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1)).isoformat()
    assert (
        client.post("/replay/preview", data={"since": "1h", "until": future}, headers=SAME).status_code == 400
    )
    _archived(pg_dsn, schema, [1, 2, 3])
    preview = client.post("/replay/preview", data={"since": "1h", "until": "1m"}, headers=SAME)
    assert "<b>3</b> archived events" in preview.text and "--upto 3" in preview.text
    form = _hidden(preview.text)
    _archived(pg_dsn, schema, [7, 8], ago="5 min")  # copies of an earlier replay, delivered meanwhile
    done = client.post("/replay/act", data=form, headers=SAME, follow_redirects=False)
    assert done.status_code == 303 and count(pg_dsn, schema, "events") == 3
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(sql.SQL("DELETE FROM {}.delivered WHERE id = 1").format(sql.Identifier(schema)))
    again = client.post("/replay/act", data=form, headers=SAME)
    assert again.status_code == 400 and again.text.startswith("planned: the window holds 2")
    assert count(pg_dsn, schema, "events") == 3
    tampered = {**form, "planned": "2", "upto": "8"}  # a hand-made form: the bound is the form's
    out = client.post("/replay/act", data=tampered, headers=SAME, follow_redirects=False)
    assert out.status_code == 400 and count(pg_dsn, schema, "events") == 3


# -- bulk dead-letter actions ------------------------------------------------------------------


def test_redrive_all_takes_no_dead_letter_made_after_the_page_loaded(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    """A dead letter keeps its event's id: an older event that dies after the page loaded has an
    id under the old mark (the highest id). The mark is the order dead letters are made in."""
    _dead(pg_dsn, schema, [(100, "orders", "a", "boom", "1 min"), (200, "orders", "b", "boom", "1 min")])
    page = client.get("/dead").text
    form = {"action": "redrive", **{k: v for k, v in _hidden(page).items() if k == "hw"}}
    _dead(pg_dsn, schema, [(50, "orders", "c", "boom", "0 min")])  # an old event, dead just now
    assert client.post("/dead/act", data=form, headers=SAME, follow_redirects=False).status_code == 303
    assert _ids(pg_dsn, schema, "dead_letters") == [50]
    assert _ids(pg_dsn, schema, "events") == [100, 200]


def test_the_command_line_the_console_shows_chooses_exactly_what_its_action_chose(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    """Error, fingerprint and time filters and the page's mark are all on it: without them, copied
    into a terminal, it acted on every dead letter of the topic."""
    _dead(pg_dsn, schema, [
        (1, "orders", "a", "MSG_TIMED_OUT: timed out after 5 s", "10 min"),
        (2, "orders", "b", "MSG_TIMED_OUT: timed out after 7 s", "3 h"),  # outside the time window
        (3, "orders", "c", "TOPIC_AUTHORIZATION_FAILED: denied", "10 min"),  # another error
        (4, "orders", "d", "msg_timed_out: TIMED OUT after 9 s", "10 min"),  # another fingerprint
        (5, "orders", "e", "MSG_TIMED_OUT: timed out after 1 s", "20 min"),
    ])  # fmt: skip
    since = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1)).isoformat()
    page = client.get("/dead", params={"error": "TIMED OUT", "since": since}).text
    form = {
        "action": "skip", "hw": _hidden(page)["hw"], "topic": "orders", "error": "TIMED OUT",
        "fingerprint": "MSG_TIMED_OUT: timed out after <n> s", "since": since,
    }  # fmt: skip
    preview = client.post("/dead/preview", data=form, headers=SAME).text
    [command] = re.findall(r"The same from the command line: <code>([^<]*)</code>", preview)
    command = command.replace("&#39;", "'").replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")
    _dead(pg_dsn, schema, [(6, "orders", "f", "MSG_TIMED_OUT: timed out after 2 s", "1 min")])  # later
    args = [*shlex.split(command)[1:-1], "--dry-run", "--dsn", pg_dsn, "--schema", schema]
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    out = subprocess.run(
        [sys.executable, "-m", "outbox", *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "would skip 2 dead letters: [1, 5]", (command, out.stdout)
    assert "<b>2</b> dead letters" in preview


# -- who acted ---------------------------------------------------------------------------------


def _actors(dsn: str, schema: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        return [
            (str(r[0]), str(r[1]))
            for r in conn.execute(
                sql.SQL("SELECT actor, db_user FROM {}.audit ORDER BY id").format(sql.Identifier(schema))
            )
        ]


def test_the_audit_trail_names_who_authorize_vouched_for_never_a_header(pg_dsn: str, schema: str) -> None:
    _dead(pg_dsn, schema, [(1, "orders", "a", "boom", "1 min"), (2, "orders", "b", "boom", "1 min")])
    mallory = {"authorization": "Basic " + base64.b64encode(b"alice:anything").decode(), **SAME}
    with _client(pg_dsn, schema, authorize=lambda r: "write") as c:  # a level, no identity
        c.post("/dead/act", data={"action": "skip", "hw": "9", "id": "1"}, headers=mallory)
    with _client(pg_dsn, schema, authorize=lambda r: ("write", "bob@sso")) as c:
        c.post("/dead/act", data={"action": "skip", "hw": "9", "id": "2"}, headers=mallory)
    (first, _), (second, _) = _actors(pg_dsn, schema)
    assert "alice" not in first and first.endswith("(console)"), first
    assert second == "bob@sso (console)"


@pytest.fixture
def console_login(pg_dsn: str, schema: str) -> Iterator[str]:
    """A login role in the outbox's console role (a DSN to it)."""
    with login_in(pg_dsn, schema, "console") as dsn:
        yield dsn


def test_the_console_role_cannot_rewrite_the_audit_trail(
    pg_dsn: str, schema: str, console_login: str
) -> None:
    """It writes audit rows only through audit_begin/audit_done, which set who and when; it
    cannot insert a row naming someone else, or finish (or refinish) a row it did not begin."""
    with psycopg.connect(pg_dsn) as conn:  # an operator's row, from the CLI
        (theirs,) = conn.execute(
            sql.SQL("SELECT {}.audit_begin('ops@host', 'cli', 'purge', '{{}}', 5)").format(
                sql.Identifier(schema)
            )
        ).fetchone()  # type: ignore[misc]
    s = sql.Identifier(schema)
    with psycopg.connect(console_login, autocommit=True) as conn:
        for statement in (
            "INSERT INTO {s}.audit (actor, db_user, via, action, selector, planned) "
            "VALUES ('x', 'someone', 'cli', 'purge', '{{}}', 1)",
            "UPDATE {s}.audit SET done = 0",
            "DELETE FROM {s}.audit",
        ):
            with pytest.raises(errors.InsufficientPrivilege):
                conn.execute(sql.SQL(statement).format(s=s))
        (mine,) = conn.execute(
            sql.SQL("SELECT {}.audit_begin('me (console)', 'console', 'skip', '{{}}', 1)").format(s)
        ).fetchone()  # type: ignore[misc]
        assert conn.execute(sql.SQL("SELECT {}.audit_done(%s, 99)").format(s), (theirs,)).fetchone() == (
            False,
        )
        assert conn.execute(sql.SQL("SELECT {}.audit_done(%s, 1)").format(s), (mine,)).fetchone() == (True,)
        assert conn.execute(sql.SQL("SELECT {}.audit_done(%s, 7)").format(s), (mine,)).fetchone() == (False,)
    with psycopg.connect(pg_dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT id, db_user, done, at <= now() FROM {}.audit ORDER BY id").format(s)
        ).fetchall()
    login = psycopg.conninfo.conninfo_to_dict(console_login)["user"]
    assert [(r[1], r[2], r[3]) for r in rows] == [("root", None, True), (login, 1, True)]


# -- what a page shows -------------------------------------------------------------------------


def test_a_big_payload_shows_its_first_64_kib_and_downloads_whole(
    pg_dsn: str, schema: str, client: TestClient
) -> None:
    big = ("x" * 1000 + "\n") * 200  # 200 KB of text
    with psycopg.connect(pg_dsn) as conn:
        event_id = outbox.enqueue(conn, "orders", big, key="k", schema=schema)
    page = client.get(f"/event/{event_id}").text
    assert len(page) < 100_000 and "the first 65536 characters shown" in page
    [link] = re.findall(r'<a class="download" href="([^"]+)"', page)
    download = client.get(link.replace("&amp;", "&"))
    assert download.status_code == 200 and download.content == big.encode()
    assert download.headers["content-type"] == "application/octet-stream"
    assert download.headers["content-disposition"].startswith("attachment;")


def test_dead_letters_are_listed_a_page_at_a_time(pg_dsn: str, schema: str, client: TestClient) -> None:
    _dead(pg_dsn, schema, [(i, "orders", f"k{i}", "boom", "1 min") for i in range(1, 251)])
    listed, pages = [], 0
    url: str | None = "/dead/list?topic=orders"
    while url is not None:
        page = client.get(url).text
        listed += [int(i) for i in re.findall(r'name="id" value="(\d+)"', page)]
        pages += 1
        found = re.findall(r'<a id="next-page" href="([^"]+)"', page)
        url = found[0].replace("&amp;", "&") if found else None
    assert pages == 3 and listed == list(range(1, 251))


def test_reading_the_whole_archive_needs_write_access(pg_dsn: str, schema: str) -> None:
    event_id = uuid.uuid4()
    with _client(pg_dsn, schema, authorize=lambda r: "read") as c:
        assert c.get(f"/event/{event_id}", params={"archive": "scan"}).status_code == 403
        assert "read the whole archive" not in c.get(f"/event/{event_id}").text
        assert c.get(f"/event/{event_id}", params={"key": "k"}).status_code == 404  # through the key
    with _client(pg_dsn, schema) as c:
        assert c.get(f"/event/{event_id}", params={"archive": "scan"}).status_code == 404


def test_no_query_parameter_s_text_is_shown_on_a_page(pg_dsn: str, schema: str, client: TestClient) -> None:
    """A link to the console could otherwise make it say anything, as if the console said it."""
    said = "Your session expired call 555-0100"
    for path, params in (
        ("/dead", {"done": said, "n": "3"}),
        ("/audit", {"done": said}),
        ("/key", {"key": said}),
        ("/event/" + str(uuid.uuid4()), {"key": said}),
        ("/dead", {"since": said}),
        ("/key", {"key": "0x" + said}),
        ("/replay", {"until": said}),
        ("/event/" + said, {}),
    ):
        page = client.get(path, params=params)
        assert "555-0100" not in page.text, (path, page.status_code, page.text[:300])
