"""The console's ASGI application (Starlette): pages, partial updates, actions.

Every page is rendered on the server (Jinja2, autoescaped); htmx swaps the overview's body in
place every few seconds while the tab is visible. Links and forms are made with ``url_for``, so
the console works mounted under any prefix of a host application.

Guards (:mod:`outbox.console.guards`), in the order they apply: the host name must be one the
console is served under (421 otherwise); ``authorize(request)`` says ``"write"``, ``"read"`` or
None (no access: 401), with who the request is for the audit trail; a POST needs write access
and a console not started read-only (403 otherwise, whatever the page showed), and must come
from this origin (403). No GET changes anything. Database work runs on worker threads, never
on the event loop: a long replay does not hold up the other pages.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import jinja2
import psycopg
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from outbox.console import data, forms
from outbox.console.guards import (
    Authorize,
    Guard,
    Visitor,
    allow_all,
    allowed_names,
    basic_auth,
    same_origin,
    unquoted,
    visitor,
)
from outbox.errors import ConfigError, OutboxError
from outbox.events import key_bytes
from outbox.operate import archive
from outbox.operate.audit import command
from outbox.store import pinning
from outbox.store.dsn import redact
from outbox.store.schema import validate_schema

HERE = Path(__file__).parent
REFRESH_SECONDS = 5  # the overview's live update, while the tab is visible
FLEET_ROOT = "outbox.fleet_root"  # in a console over several outboxes: where the fleet page is
POOL_SIZE = 4
TRACE_ID = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")
T = TypeVar("T")

__all__ = ["Authorize", "app", "basic_auth"]


def new_pool(dsn: str) -> ConnectionPool[Any]:
    """The console's connections to one database (opened at the first request)."""
    return ConnectionPool(
        dsn,
        min_size=1,
        max_size=POOL_SIZE,
        kwargs={"autocommit": True, "application_name": "outbox-console"},
        configure=pinning.pin,  # search_path pinned before the pool hands a connection out
        open=False,
        name="outbox-console",
    )


def new_templates() -> Jinja2Templates:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters["age"] = forms.age
    env.filters["when"] = forms.when
    return Jinja2Templates(env=env)


class Console:
    """One outbox's console state: the pool, the options, the templates."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        *,
        read_only: bool,
        authorize: Authorize | None,
        hide_payloads: bool,
        trace_url: str | None,
        pool: ConnectionPool[Any] | None = None,
        name: str | None = None,
        templates: Jinja2Templates | None = None,
    ) -> None:
        self.schema = validate_schema(schema, "schema")
        self.name = name  # the outbox's name in a console over several (None: the only one)
        self.read_only = read_only
        self.authorize = authorize or allow_all
        self.hide_payloads = hide_payloads
        self.trace_url = trace_url
        self.where = redact(dsn)
        # One pool per database: a console over a thousand outboxes of one database shares it.
        self.pool = pool if pool is not None else new_pool(dsn)
        self._opening = threading.Lock()
        self._opened = False
        self.templates = templates or new_templates()

    @contextmanager
    def conn(self) -> Iterator[psycopg.Connection[Any]]:
        # Opened at the first request, not at startup: a console mounted in a host application
        # gets no lifespan events of its own.
        if not self._opened:
            with self._opening:
                if not self._opened:
                    self.pool.open(wait=False)
                    self._opened = True
        with self.pool.connection() as conn:
            yield conn

    async def run(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """``work`` on a pooled connection, on a worker thread (never on the event loop)."""

        def on_a_connection() -> T:
            with self.conn() as conn:
                return work(conn)

        return await run_in_threadpool(on_a_connection)

    def trace_link(self, headers: dict[str, Any]) -> str | None:
        parent = headers.get("traceparent")
        if not self.trace_url or not isinstance(parent, str):
            return None
        m = TRACE_ID.match(parent.strip())
        return self.trace_url.replace("{trace_id}", m.group(1)) if m else None

    def access(self, request: Request, write: bool = False) -> Response | Visitor:
        """Who the caller is and what it may do, or the response that refuses it."""
        who = visitor(self.authorize, request)
        if who is None:
            headers = (
                {"WWW-Authenticate": 'Basic realm="outbox console"'}
                if getattr(self.authorize, "basic", False)
                else {}
            )
            return PlainTextResponse("authentication required", status_code=401, headers=headers)
        can_write = who.level == "write" and not self.read_only
        if write:
            if not can_write:
                return PlainTextResponse("read-only: this console does not change events", 403)
            if not same_origin(request):
                return PlainTextResponse("refused: a cross-site request", 403)
        return dataclasses.replace(who, level="write" if can_write else "read")

    def page(
        self, request: Request, template: str, who: Visitor, status_code: int = 200, **context: Any
    ) -> Response:
        context.setdefault("fleet_page", False)
        return self.templates.TemplateResponse(
            request,
            template,
            status_code=status_code,
            context={
                "fleet_url": request.scope.get(FLEET_ROOT),
                "can_write": who.level == "write",
                "read_only": self.read_only,
                "schema": self.schema,
                "outbox_name": self.name,
                "where": self.where,
                "refresh": REFRESH_SECONDS,
                **context,
            },
        )


class Search(NamedTuple):
    """An event page's search: who asks, the event's id, the key to search the archive under,
    and whether to read the whole archive."""

    who: Visitor
    event_id: str
    key: str | None
    scan: bool

    @property
    def query(self) -> dict[str, str]:
        """The search as a link's query parameters (its payloads' downloads search the same)."""
        return {
            **({"key": self.key} if self.key is not None else {}),
            **({"archive": "scan"} if self.scan else {}),
        }

    def rows(self, conn: psycopg.Connection[Any], schema: str) -> list[dict[str, Any]]:
        return data.event(conn, schema, self.event_id, key=self.key, scan=self.scan)


def _bounded(conn: psycopg.Connection[Any], schema: str, chosen: data.DeadFilter) -> data.DeadFilter:
    """``chosen`` with this page's high-water mark: the one it came with, else the last one now."""
    if chosen.high_water:
        return chosen
    return dataclasses.replace(chosen, high_water=data.high_water(conn, schema))


def app(
    dsn: str,
    *,
    schema: str = "outbox",
    read_only: bool = False,
    authorize: Authorize | None = None,
    hide_payloads: bool = False,
    trace_url: str | None = None,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The console as an ASGI application, to run (``outbox console``) or to mount in your own.

    ``authorize(request)`` returns ``"write"``, ``"read"`` or None (refused), or ``(level,
    identity)``: the identity is who the audit trail says acted. Without it every request may
    write: give one whenever the console is reachable by anyone else. ``allowed_hosts``: the
    host names it answers to, besides loopback ones (``"*"``: any); by default loopback names
    only, or any when ``authorize`` is given (the host application checks its own).
    """
    c = Console(
        dsn, schema, read_only=read_only, authorize=authorize, hide_payloads=hide_payloads,
        trace_url=trace_url,
    )  # fmt: skip

    @asynccontextmanager
    async def lifespan(_: Starlette) -> Any:
        try:
            yield
        finally:
            c.pool.close()

    return Starlette(
        routes=outbox_routes(c),
        lifespan=lifespan,
        exception_handlers={OutboxError: refused},
        middleware=[Middleware(Guard, names=allowed_names(allowed_hosts, authorize is not None))],
    )


async def refused(request: Request, exc: Exception) -> Response:
    # Bad input, named: a field and why, without the value (a link could make it say anything).
    return PlainTextResponse(unquoted(str(exc)), status_code=400)


def outbox_routes(c: Console) -> list[BaseRoute]:
    """One outbox's pages and actions (the console of one outbox, or each outbox's under its name
    in a console over several: :mod:`outbox.console.fleet`)."""

    async def overview(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        view = await c.run(lambda conn: data.overview(conn, c.schema))
        partial = request.headers.get("hx-request") == "true"
        return c.page(request, "_overview.html" if partial else "overview.html", who, **view)

    async def chart(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        return JSONResponse(await c.run(lambda conn: data.chart(conn, c.schema)))

    async def dead_letters(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        event_id = request.query_params.get("event_id", "").strip()
        if event_id:
            found = request.url_for("event", event_id=event_id)
            key = request.query_params.get("key", "").strip()
            return RedirectResponse(
                str(found.include_query_params(key=key) if key else found), status_code=303
            )
        chosen = forms.dead_filter(request.query_params)

        def read(conn: psycopg.Connection[Any]) -> tuple[data.DeadFilter, list[dict[str, Any]]]:
            bounded = _bounded(conn, c.schema, chosen)
            return bounded, data.dead_groups(conn, c.schema, bounded)

        bounded, groups = await c.run(read)
        done = request.query_params.get("done")
        return c.page(
            request, "dead.html", who, groups=groups, chosen=bounded,
            done=done if done in data.ACTIONS else None, n=forms.count_of(request.query_params.get("n")),
        )  # fmt: skip

    async def dead_list(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        chosen = forms.dead_filter(request.query_params)
        after = forms.count_of(request.query_params.get("after")) or 0

        def read(conn: psycopg.Connection[Any]) -> tuple[data.DeadFilter, dict[str, Any]]:
            bounded = _bounded(conn, c.schema, chosen)
            return bounded, data.dead_list(conn, c.schema, bounded, after)

        bounded, listed = await c.run(read)
        return c.page(request, "dead_list.html", who, chosen=bounded, page_size=data.PAGE, **listed)

    async def preview(request: Request) -> Response:
        who = c.access(request, write=True)
        if isinstance(who, Response):
            return who
        action, chosen = forms.action(await request.form())
        counts = await c.run(lambda conn: data.preview(conn, c.schema, chosen, action))
        return c.page(
            request, "preview.html", who, action=action, chosen=chosen, counts=counts,
            command=command(action, chosen.audited(action)),
        )  # fmt: skip

    async def act(request: Request) -> Response:
        who = c.access(request, write=True)
        if isinstance(who, Response):
            return who
        action, chosen = forms.action(await request.form())
        n = await c.run(lambda conn: data.act(conn, c.schema, action, chosen, who.actor))
        url = request.url_for("dead_letters").include_query_params(done=action, n=n)
        return RedirectResponse(str(url), status_code=303)

    async def key(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        name = request.query_params.get("key", "")
        if not name:
            return PlainTextResponse("key: give the key (UTF-8 text, or 0x… for bytes)", status_code=400)

        def read(conn: psycopg.Connection[Any]) -> tuple[dict[str, Any], int]:
            return data.timeline(conn, c.schema, name), data.high_water(conn, c.schema)

        view, hw = await c.run(read)
        return c.page(request, "key.html", who, hw=hw, **view)

    def _searched(request: Request) -> Search | Response:
        """Who asks for an event page (or its payload), the event's id, the key to search the
        archive under, and whether to read the whole archive (write access only: a whole-archive
        read is a load to ask for by name); or the response that refuses it."""
        who = c.access(request)
        if isinstance(who, Response):
            return who
        event_id = request.path_params["event_id"]
        try:
            uuid.UUID(event_id)
        except ValueError:
            return PlainTextResponse("event id: not a UUID", status_code=400)
        scan = request.query_params.get("archive") == "scan"
        if scan and who.level != "write":
            return PlainTextResponse(
                "archive=scan: reading the whole archive needs write access; give the event's key", 403
            )
        return Search(who, event_id, request.query_params.get("key") or None, scan)

    async def event(request: Request) -> Response:
        s = _searched(request)
        if isinstance(s, Response):
            return s

        def read(conn: psycopg.Connection[Any]) -> tuple[list[dict[str, Any]], int]:
            return s.rows(conn, c.schema), data.high_water(conn, c.schema)

        rows, hw = await c.run(read)
        searched = {"key": s.key, "scan": s.scan, "query": s.query}
        if not rows:
            return c.page(
                request, "event.html", s.who, rows=[], event_id=s.event_id, hw=hw, searched=searched,
                status_code=404,
            )  # fmt: skip
        for row in rows:
            row["view"] = forms.payload_view(row.pop("payload"))
            row["trace"] = c.trace_link(row["headers"])
        return c.page(
            request, "event.html", s.who, rows=rows, event_id=s.event_id, hw=hw, hide=c.hide_payloads,
            searched=searched,
        )  # fmt: skip

    async def payload(request: Request) -> Response:
        """One row's whole payload, as a download (never shown as a page)."""
        s = _searched(request)
        if isinstance(s, Response):
            return s
        state, row_id = request.path_params["state"], request.path_params["row"]
        rows = await c.run(lambda conn: s.rows(conn, c.schema))
        match = [r for r in rows if r["state"] == state and r["id"] == row_id]
        if not match:
            return PlainTextResponse("no such payload", status_code=404)
        return Response(
            match[0]["payload"],
            media_type="application/octet-stream",
            headers={"content-disposition": f'attachment; filename="{s.event_id}-{state}-{row_id}.bin"'},
        )

    async def replay_form(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        return c.page(request, "replay.html", who, window=forms.window(request.query_params), counts=None)

    async def replay_preview(request: Request) -> Response:
        who = c.access(request, write=True)
        if isinstance(who, Response):
            return who
        window = forms.window(await request.form())
        if window["since"] is None:
            raise ConfigError("since: required")

        def count(conn: psycopg.Connection[Any]) -> tuple[int, int]:
            key = key_bytes(window["key"], "key")
            return archive.replay_count(
                conn, c.schema, since=window["since"], until=window["until"], topic=window["topic"], key=key
            )

        n, upto = await c.run(count)
        window["upto"] = upto
        chosen = {k: v.isoformat() if isinstance(v, dt.datetime) else v for k, v in window.items() if v}
        return c.page(request, "replay.html", who, window=window, counts=n, command=command("replay", chosen))

    async def replay_act(request: Request) -> Response:
        who = c.access(request, write=True)
        if isinstance(who, Response):
            return who
        form = await request.form()
        window = forms.window(form)
        planned = forms.count_of(str(form.get("planned", "")))
        if window["since"] is None or window["upto"] is None or planned is None:
            raise ConfigError("planned: the preview's count and highest id are missing; preview it first")

        def replay(conn: psycopg.Connection[Any]) -> int:
            return archive.replay_recorded(
                conn, c.schema, since=window["since"], until=window["until"], topic=window["topic"],
                key=window["key"], planned=planned, upto=window["upto"], via="console", actor=who.actor,
            )  # fmt: skip

        done = await c.run(replay)
        url = request.url_for("audit").include_query_params(done="replay", n=done)
        return RedirectResponse(str(url), status_code=303)

    async def trail(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        rows = await c.run(lambda conn: data.trail(conn, c.schema))
        done = request.query_params.get("done")
        return c.page(
            request, "audit.html", who, rows=rows, done=done if done == "replay" else None,
            n=forms.count_of(request.query_params.get("n")),
        )  # fmt: skip

    return [
        Route("/", overview, name="overview"),
        Route("/chart.json", chart, name="chart"),
        Route("/dead", dead_letters, name="dead_letters"),
        Route("/dead/list", dead_list, name="dead_list"),
        Route("/dead/preview", preview, methods=["POST"], name="preview"),
        Route("/dead/act", act, methods=["POST"], name="act"),
        Route("/key", key, name="key"),
        Route("/event/{event_id}", event, name="event"),
        Route("/event/{event_id}/payload/{state}/{row:int}", payload, name="payload"),
        Route("/audit", trail, name="audit"),
        Route("/replay", replay_form, name="replay"),
        Route("/replay/preview", replay_preview, methods=["POST"], name="replay_preview"),
        Route("/replay/act", replay_act, methods=["POST"], name="replay_act"),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
