"""The console in a real browser (Playwright driving Debian's chromium), against a relay that
delivers to the broker: find a parked key, open its timeline, redrive its dead letter through the
preview, see the key's events reach the broker in order and the overview update without a
reload. A read-only console offers no action. Each page's screenshot is saved
(OUTBOX_TEST_SCREENSHOTS, else the test's own directory; scripts/console-screenshots puts
them in docs/console/)."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from psycopg import sql

import outbox
from outbox.harness.embedded import free_port
from tests.helpers import FAST, ModuleProcess, RelayProcess, count, read_topic, wait_for

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
KEY = "c-7"
# The suite runs in parallel on two cores: a page may take seconds to answer, not milliseconds.
expect.set_options(timeout=30_000)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with sync_playwright() as p:
        # Never `playwright install` (it downloads): the machine's chromium, as root without a sandbox.
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"], timeout=60_000)
        yield b
        b.close()


def _console(dsn: str, schema: str, *extra: str) -> tuple[ModuleProcess, str]:
    port = free_port()
    proc = ModuleProcess("outbox", "console", "--dsn", dsn, "--schema", schema, "--port", str(port), *extra)

    def up() -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(up, timeout=30, what=f"the console on port {port}\n{proc.output()}")
    return proc, f"http://127.0.0.1:{port}"


def _shots(tmp_path: Path) -> Path:
    out = Path(os.environ.get("OUTBOX_TEST_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


def _shot(page: Page, where: Path, name: str) -> None:
    page.screenshot(path=str(where / f"{name}.png"), full_page=True)


def test_find_a_parked_key_redrive_it_and_watch_it_flow(
    pg_dsn: str, schema: str, kafka: str, topic: str, browser: Browser, tmp_path: Path
) -> None:
    shots = _shots(tmp_path)
    with psycopg.connect(pg_dsn) as conn:
        # Other keys flow; c-7's first event failed for good (a fixed cause, say) and parks its key.
        outbox.enqueue_many(
            conn,
            [
                {
                    "topic": topic,
                    "key": f"k{i % 5}",
                    "payload": {"i": i},
                    "headers": {"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"},
                }
                for i in range(40)
            ],
            schema=schema,
        )
        dead_id = conn.execute(
            sql.SQL("SELECT nextval(pg_get_serial_sequence('{}.events', 'id'))").format(
                sql.Identifier(schema)
            )
        ).fetchone()[0]
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, attempts, error, "
                "first_failed_at, failed_at, parked) VALUES (%s, gen_random_uuid(), %s, %s, %s, '{{}}', now(), 10, "
                "'MSG_SIZE_TOO_LARGE: message of 1200345 bytes > 1048576', now(), now(), true)"
            ).format(sql.Identifier(schema)),
            (dead_id, topic, KEY.encode(), json.dumps({"seq": 0}).encode()),
        )
        outbox.enqueue_many(
            conn, [{"topic": topic, "key": KEY, "payload": {"seq": s}} for s in (1, 2, 3)], schema=schema
        )
    relay = RelayProcess(pg_dsn, schema, kafka, *FAST)
    console, base = _console(pg_dsn, schema)
    try:
        wait_for(
            lambda: count(pg_dsn, schema, "delivered") == 40, timeout=60, what="the other keys delivered"
        )
        assert count(pg_dsn, schema, "events", f"key = '{KEY}'") == 3, "c-7's events are parked"
        # The console's Content-Security-Policy runs no inline script or style from elsewhere: a
        # page that needed one would say so in the browser's console.
        refused: list[str] = []
        watcher = browser.new_page()
        watcher.on(
            "console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None
        )
        watcher.set_default_timeout(30_000)
        watcher.goto(base + "/")
        row = watcher.locator(f'tr[data-topic="{topic}"]')
        expect(row).to_contain_text("1")  # one dead letter
        watcher.evaluate("window.__loaded = 'once'")
        _shot(watcher, shots, "overview")

        page = browser.new_page()
        page.on("console", lambda m: refused.append(m.text) if "Content Security Policy" in m.text else None)
        page.set_default_timeout(30_000)
        page.goto(base + "/")
        page.get_by_role("link", name="Dead letters").click()
        expect(page.locator("#groups")).to_contain_text("MSG_SIZE_TOO_LARGE: message of <n> bytes > <n>")
        _shot(page, shots, "dead-letters")
        page.locator("#groups").get_by_role("link", name=KEY).click()
        expect(page.locator("#parked")).to_contain_text("holds back 3 later events")
        _shot(page, shots, "key-timeline")
        page.get_by_role("button", name="redrive its dead letters…").click()
        expect(page.locator("#preview")).to_contain_text(
            "1 dead letters over 1 keys; 3 parked events will follow them"
        )
        _shot(page, shots, "preview")
        page.get_by_role("button", name="redrive 1 dead letters").click()
        expect(page.locator("p.done")).to_contain_text("redrive: 1 dead letters")

        messages = read_topic(kafka, topic, 44, timeout=60)
        seqs = [json.loads(m.value)["seq"] for m in messages if m.key == KEY.encode()]
        assert seqs == [0, 1, 2, 3], "the key's events reached the broker out of order"

        # The overview opened before the redrive shows it without a reload.
        expect(row.locator("td").nth(3)).to_have_text("0")
        assert watcher.evaluate("window.__loaded") == "once", "the page was reloaded"
        expect(watcher.locator("#relays")).to_contain_text("ready")
        watcher.wait_for_function("document.querySelector('#chart canvas') !== null")
        _shot(watcher, shots, "overview-after")

        page.goto(base + f"/key?key={KEY}")
        _shot(page, shots, "key-timeline-after")
        page.locator("#timeline a").first.click()
        expect(page.locator("h1")).to_contain_text("Event")
        _shot(page, shots, "event")
        page.get_by_role("link", name="Audit").click()
        expect(page.locator("#audit")).to_contain_text("outbox dead redrive --key c-7")
        _shot(page, shots, "audit")
        assert refused == [], refused
    finally:
        console.close()
        relay.close()


def test_read_only_offers_no_action(pg_dsn: str, schema: str, browser: Browser, tmp_path: Path) -> None:
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            sql.SQL(
                "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, attempts, error, "
                "first_failed_at, failed_at, parked) VALUES (1, gen_random_uuid(), 'orders', 'c-7', 'x', '{{}}', now(), "
                "10, 'boom', now(), now(), true)"
            ).format(sql.Identifier(schema))
        )
    console, base = _console(pg_dsn, schema, "--read-only")
    try:
        page = browser.new_page()
        for path in ("/", "/dead", f"/key?key={KEY}", "/replay", "/audit"):
            page.goto(base + path)
            expect(page.locator("header")).to_contain_text("read-only")
            assert page.locator('form[method="post"]').count() == 0, path
            assert page.get_by_role("button", name=re.compile("redrive|skip|replay", re.I)).count() == 0, path
        _shot(page, _shots(tmp_path), "read-only")
    finally:
        console.close()


def test_the_fleet_page_into_an_outbox_and_back_and_an_action_there_changes_no_other(
    pg_dsn: str, prefix: str, browser: Browser, tmp_path: Path
) -> None:
    """``outbox console --schemas``: the fleet page lists each outbox; its link opens that
    outbox's pages, whose Fleet link leads back; a redrive there leaves the other outbox's dead
    letters (the same ids, topic and key) as they were."""
    from outbox.store.migrate import migrate

    schemas = [f"{prefix}_north", f"{prefix}_south"]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        for s in schemas:
            migrate(conn, s)
            conn.execute(
                sql.SQL(
                    "INSERT INTO {}.dead_letters (id, event_id, topic, key, payload, headers, created_at, attempts, "
                    "error, first_failed_at, failed_at, parked) VALUES (1, gen_random_uuid(), 'orders', 'c-7', "
                    "'x', '{{}}', now(), 10, 'boom', now(), now(), true)"
                ).format(sql.Identifier(s))
            )
    port = free_port()
    console = ModuleProcess(
        "outbox", "console", "--dsn", pg_dsn, "--schemas", f"{prefix}_*", "--port", str(port)
    )

    def up() -> bool:
        with socket.socket() as s:
            s.settimeout(0.2)
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(up, timeout=30, what=f"the console on port {port}\n{console.output()}")
    base, shots = f"http://127.0.0.1:{port}", _shots(tmp_path)
    north, south = schemas
    try:
        page = browser.new_page()
        page.set_default_timeout(30_000)
        page.goto(base + "/")
        expect(page.locator(f'tr[data-outbox="{north}"] td.dead')).to_have_text("1")
        expect(page.locator(f'tr[data-outbox="{south}"] td.dead')).to_have_text("1")
        _shot(page, shots, "fleet")
        page.locator("#fleet-filter input[name=find]").fill("north")
        page.locator("#fleet-filter input[name=find]").press("Enter")
        expect(page.locator("#fleet tbody tr")).to_have_count(1)
        page.get_by_role("link", name=north).click()
        expect(page.locator("#outbox-name")).to_have_text(north)
        page.get_by_role("link", name="Dead letters").click()
        page.locator("#groups").get_by_role("link", name=KEY).click()
        page.get_by_role("button", name="redrive its dead letters…").click()
        page.get_by_role("button", name="redrive 1 dead letters").click()
        expect(page.locator("p.done")).to_contain_text("redrive: 1 dead letters")
        assert f"/o/{north}/" in page.url
        page.locator("#fleet-link").click()
        expect(page.locator(f'tr[data-outbox="{north}"] td.dead')).to_have_text("0")
        expect(page.locator(f'tr[data-outbox="{south}"] td.dead')).to_have_text("1")
        page.get_by_role("link", name="Audit").click()
        expect(page.locator("#audit tbody tr")).to_have_count(1)
        expect(page.locator("#audit")).to_contain_text(north)
        _shot(page, shots, "fleet-audit")
    finally:
        console.close()
    assert count(pg_dsn, south, "dead_letters") == 1 and count(pg_dsn, south, "events") == 0
    assert count(pg_dsn, north, "dead_letters") == 0 and count(pg_dsn, north, "events") == 1
