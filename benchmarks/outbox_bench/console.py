"""The console scenario: how fast each page of ``outbox console`` answers at a size.

It fills a fresh schema with ``console_pending`` pending events (one in a hundred retrying),
``console_dead`` dead letters over ``console_dead_keys`` keys (each key's first one parks it)
and ``console_archived`` archived events delivered evenly over the last ``console_days``
days, in day partitions as a relay running that long made them; then vacuums and analyzes
as autovacuum would have. The rows are what ``enqueue`` and the relay write: orders as
JSON with their ``traceparent``, keyed by customer, with Kafka coordinates in the archive.
The fill is SQL (``generate_series``), not ``enqueue``: ten million archived events through
a relay would take the bench an hour and measure nothing more.

Then it starts ``outbox console`` as a user does (uvicorn, on a free loopback port) and asks
each page ``console_requests`` times over one keep-alive HTTP connection, after two warm-up
requests: p50 and p95 of the time to the last byte.
"""

from __future__ import annotations

import datetime as dt
import http.client
import os
import subprocess
import sys
import time
import urllib.parse
import uuid
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox.extras import require
from outbox.harness.embedded import free_port
from outbox.observe.progress import Progress
from outbox.store.dsn import for_child
from outbox.store.migrate import migrate
from outbox_bench.config import BenchConfig
from outbox_bench.measure import percentiles
from outbox_bench.queries import query

TOPICS = 4
PENDING_PER_KEY = 10  # 1,000,000 pending events over 100,000 customers
ARCHIVED_PER_KEY = 100  # 10,000,000 archived events over 100,000 customers
CHUNK = 250_000  # rows per INSERT while filling (a progress step)
TARGET_MS = 300.0  # issue 27: every page within 300 ms at the full size


def _fill(conn: psycopg.Connection[Any], schema: str, cfg: BenchConfig) -> None:
    today = dt.datetime.now(dt.timezone.utc).date()
    for back in range(cfg.console_days + 1):
        day = today - dt.timedelta(days=back)
        lo = dt.datetime.combine(day, dt.time(), dt.timezone.utc)
        conn.execute(
            query(
                "console_fill_archive_day", schema,
                identifiers={"partition": f"delivered_p{day:%Y%m%d}"},
                literals={"since": lo.isoformat(), "until": (lo + dt.timedelta(days=1)).isoformat()},
            )
        )  # fmt: skip
    conn.execute(query("console_fill_functions", schema))
    total = cfg.console_archived + cfg.console_dead + cfg.console_pending
    progress = Progress("console fill", total, " rows")
    done = 0
    for first in range(1, cfg.console_archived + 1, CHUNK):
        last = min(cfg.console_archived, first + CHUNK - 1)
        conn.execute(
            query("console_fill_archive", schema),
            {"first": first, "last": last, "total": cfg.console_archived, "days": cfg.console_days,
             "keys": max(1, cfg.console_archived // ARCHIVED_PER_KEY), "topics": TOPICS},
        )  # fmt: skip
        done += last - first + 1
        progress.update(done, "archive")
    conn.execute(
        query("console_fill_dead", schema),
        {"n": cfg.console_dead, "keys": cfg.console_dead_keys, "topics": TOPICS},
    )
    done += cfg.console_dead
    progress.update(done, "dead letters")
    base = cfg.console_dead  # pending ids come after every dead letter's
    for first in range(base + 1, base + cfg.console_pending + 1, CHUNK):
        last = min(base + cfg.console_pending, first + CHUNK - 1)
        conn.execute(
            query("console_fill_pending", schema),
            {
                "first": first,
                "last": last,
                "keys": max(1, cfg.console_pending // PENDING_PER_KEY),
                "topics": TOPICS,
            },
        )
        done += last - first + 1
        progress.update(done, "pending")
    conn.execute(query("console_fill_done", schema))
    progress.update(done, "vacuum analyze")
    conn.execute(query("bench_vacuum_outbox", schema))
    progress.close()


def _pages(conn: psycopg.Connection[Any], schema: str) -> dict[str, Request]:
    """Each measured request by name, on a parked key and its events."""
    from outbox.console import data  # the console's own grouping names the group to open

    row = conn.execute(query("console_bench_samples", schema)).fetchone()
    assert row is not None and all(v is not None for v in row), f"the fill left nothing to look at: {row}"
    pending_id, dead_id, delivered_id, parked_key, hw = row
    [biggest, *_] = data.dead_groups(conn, schema, data.DeadFilter(high_water=int(hw)))
    group = {"hw": str(hw), "topic": biggest["topic"], "fingerprint": biggest["fingerprint"]}
    now = dt.datetime.now(dt.timezone.utc)
    hour = {
        "since": (now - dt.timedelta(hours=2)).isoformat(),
        "until": (now - dt.timedelta(hours=1)).isoformat(),
    }

    def get(path: str, **params: str) -> Request:
        return Request("GET", path + ("?" + urllib.parse.urlencode(params) if params else ""))

    return {
        "overview": get("/"),
        "overview (live refresh)": Request("GET", "/", htmx=True),
        "chart (last hour)": get("/chart.json"),
        "dead letters, grouped": get("/dead"),
        "dead letters, by topic": get("/dead", topic=biggest["topic"]),
        "dead letters, by error text": get("/dead", error="too large"),
        "dead letters, by key": get("/dead", key=parked_key),
        "a group's dead letters": get("/dead/list", **group),
        "a key's timeline": get("/key", key=parked_key),
        "event (pending)": get(f"/event/{pending_id}"),
        "event (dead letter)": get(f"/event/{dead_id}"),
        "event (archived)": get(f"/event/{delivered_id}", key=parked_key),
        "event (archived, id alone: archive read whole)": Request(
            "GET", f"/event/{delivered_id}?archive=scan", target=False
        ),
        "redrive preview (a group)": Request("POST", "/dead/preview", {"action": "redrive", **group}),
        "replay preview (an hour)": Request("POST", "/replay/preview", hour),
        "audit trail": get("/audit"),
    }


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    form: dict[str, str] = field(default_factory=dict)
    htmx: bool = False  # the overview's live refresh asks for its fragment
    target: bool = True  # False: a slow path the user asks for by name (not held to the target)


def _ask(http_conn: http.client.HTTPConnection, r: Request) -> float:
    """One request; its time to the last byte, in ms. Anything but a 200 fails the scenario."""
    headers = {"Sec-Fetch-Site": "same-origin"}
    body = None
    if r.htmx:
        headers["HX-Request"] = "true"
    if r.method == "POST":
        body = urllib.parse.urlencode(r.form)
        headers["Content-Type"] = "application/x-www-form-urlencoded"
    started = time.perf_counter()
    http_conn.request(r.method, r.path, body=body, headers=headers)
    response = http_conn.getresponse()
    content = response.read()
    took = (time.perf_counter() - started) * 1000
    if response.status != 200:
        raise RuntimeError(f"console {r.method} {r.path}: HTTP {response.status}: {content[:200]!r}")
    return took


def _serve(dsn: str, schema: str, port: int) -> subprocess.Popen[bytes]:
    dsn, secret = for_child(dsn)
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox", "console", "--dsn", dsn, "--schema", schema, "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env={**os.environ, **secret, "OUTBOX_CONSOLE_PASSWORD": ""},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"outbox console exited: {proc.stderr.read().decode()[-500:] if proc.stderr else ''}"
            )
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", "/static/console.css")
            c.getresponse().read()
            c.close()
            return proc
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("outbox console did not answer within 60 s")


def console(cfg: BenchConfig) -> dict[str, Any]:
    require("console", "outbox bench --scenarios console")
    schema = f"bench_console_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(cfg.dsn, autocommit=True) as conn:
        migrate(conn, schema)
        try:
            started = time.monotonic()
            _fill(conn, schema, cfg)
            fill_s = time.monotonic() - started
            sizes = {
                name: int(n)
                for name, n in zip(
                    ("pending", "dead_letters", "archived", "bytes"),
                    conn.execute(query("console_bench_sizes", schema)).fetchone() or (),
                    strict=True,
                )
            }
            pages = _pages(conn, schema)
            port = free_port()
            proc = _serve(cfg.dsn, schema, port)
            try:
                out: dict[str, Any] = {}
                progress = Progress("console pages", len(pages) * (cfg.console_requests + 2), " requests")
                http_conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
                done = 0
                for name, request in pages.items():
                    times = [_ask(http_conn, request) for _ in range(cfg.console_requests + 2)][2:]
                    done += cfg.console_requests + 2
                    progress.update(done, name)
                    p = percentiles(times)
                    out[name] = {
                        "request": f"{request.method} {request.path}",
                        "p50_ms": p["p50"],
                        "p95_ms": p["p95"],
                        "target": request.target,
                    }
                progress.close()
                http_conn.close()
            finally:
                proc.terminate()
                proc.wait(30)
        finally:
            conn.execute(query("harness_drop_schema", schema))
    return {
        "sizes": sizes,
        "days": cfg.console_days,
        "requests": cfg.console_requests,
        "fill_seconds": round(fill_s, 1),
        "target_ms": TARGET_MS,
        "pages": out,
    }
