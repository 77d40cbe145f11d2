"""The console's ASGI application (Starlette): pages, partial updates, actions, and their guards.

Every page is rendered on the server (Jinja2, autoescaped); htmx swaps the overview's body in
place every few seconds while the tab is visible. Links and forms are made with ``url_for``, so
the console works mounted under any prefix of a host application.

Guards, in the order they apply: ``authorize(request)`` says ``"write"``, ``"read"`` or None (no
access: 401); a POST needs write access and a console not started read-only (403 otherwise,
whatever the page showed), and must come from this origin (``Sec-Fetch-Site``, else ``Origin``
against ``Host``: 403). No GET changes anything.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import hmac
import json
import re
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import jinja2
import psycopg
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from outbox import archive
from outbox.audit import command
from outbox.console import data
from outbox.dsn import redact
from outbox.errors import ConfigError, OutboxError
from outbox.events import key_bytes
from outbox.schema import validate_schema

HERE = Path(__file__).parent
Authorize = Callable[[Request], "str | None"]
REFRESH_SECONDS = 5  # the overview's live update, while the tab is visible
POOL_SIZE = 4
TRACE_ID = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-[0-9a-f]{16}-[0-9a-f]{2}$")


def basic_auth(user: str, password: str, *, level: str = "write") -> Authorize:
    """``authorize`` for the standalone console: HTTP basic with one user and password."""
    expected = f"{user}:{password}".encode()

    def authorize(request: Request) -> str | None:
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            given = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
        return level if hmac.compare_digest(given, expected) else None

    authorize.basic = True  # type: ignore[attr-defined]  # 401s ask the browser for a password
    return authorize


def _allow_all(request: Request) -> str | None:
    return "write"


def _same_origin(request: Request) -> bool:
    """A state-changing request must come from a page of this console (or from no browser)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    origin = request.headers.get("origin")
    if origin is None:
        return True  # not a browser: curl, a script (authorization still applies)
    host = request.headers.get("host", "")
    return origin != "null" and urllib.parse.urlsplit(origin).netloc == host


def _time(text: str | None, name: str) -> dt.datetime | None:
    """An ISO time (UTC without a zone) or a duration ago (``2h``), as ``outbox replay`` takes them."""
    return archive.parse_time(text, name, dt.datetime.now(dt.timezone.utc)) if text else None


def _payload_view(payload: bytes) -> dict[str, Any]:
    """How a payload shows: pretty JSON, text, or hex."""
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        return {"kind": "bytes", "text": payload.hex(" ", 2), "size": len(payload)}
    try:
        pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
        return {"kind": "json", "text": pretty, "size": len(payload)}
    except ValueError:
        return {"kind": "text", "text": text, "size": len(payload)}


class Console:
    """The application's state: the pool, the options, the templates."""

    def __init__(
        self,
        dsn: str,
        schema: str,
        *,
        read_only: bool,
        authorize: Authorize | None,
        hide_payloads: bool,
        trace_url: str | None,
    ) -> None:
        self.schema = validate_schema(schema, "schema")
        self.read_only = read_only
        self.authorize = authorize or _allow_all
        self.hide_payloads = hide_payloads
        self.trace_url = trace_url
        self.where = redact(dsn)
        self.pool = ConnectionPool(
            dsn,
            min_size=1,
            max_size=POOL_SIZE,
            kwargs={"autocommit": True, "application_name": "outbox-console"},
            open=False,
            name="outbox-console",
        )
        self._opening = threading.Lock()
        self._opened = False
        env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
        )
        env.filters["age"] = _age
        env.filters["when"] = _when
        self.templates = Jinja2Templates(env=env)

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

    def trace_link(self, headers: dict[str, Any]) -> str | None:
        parent = headers.get("traceparent")
        if not self.trace_url or not isinstance(parent, str):
            return None
        m = TRACE_ID.match(parent.strip())
        return self.trace_url.replace("{trace_id}", m.group(1)) if m else None

    # -- guards -------------------------------------------------------------------------------

    def access(self, request: Request, write: bool = False) -> Response | str:
        """The caller's access level, or the response that refuses it."""
        level = self.authorize(request)
        if level not in ("read", "write"):
            headers = (
                {"WWW-Authenticate": 'Basic realm="outbox console"'}
                if getattr(self.authorize, "basic", False)
                else {}
            )
            return PlainTextResponse("authentication required", status_code=401, headers=headers)
        can_write = level == "write" and not self.read_only
        if write:
            if not can_write:
                return PlainTextResponse("read-only: this console does not change events", 403)
            if not _same_origin(request):
                return PlainTextResponse("refused: a cross-site request", 403)
        return "write" if can_write else "read"

    def page(
        self, request: Request, template: str, level: str, status_code: int = 200, **context: Any
    ) -> Response:
        return self.templates.TemplateResponse(
            request,
            template,
            status_code=status_code,
            context={
                "can_write": level == "write",
                "read_only": self.read_only,
                "schema": self.schema,
                "where": self.where,
                "refresh": REFRESH_SECONDS,
                **context,
            },
        )


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def _when(value: dt.datetime | str | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _window(src: Any) -> dict[str, Any]:
    """A replay window from a query string or form: since (required), until (default: now, fixed
    here, so that what the preview counted is what the action replays), topic, key."""

    def text(name: str) -> str | None:
        value = src.get(name)
        return value.strip() if isinstance(value, str) and value.strip() else None

    now = dt.datetime.now(dt.timezone.utc)
    since = _time(text("since"), "since")
    until = _time(text("until"), "until") or now
    if since is not None and until <= since:
        raise ConfigError(f"until: must be after since ({since.isoformat()})")
    return {"since": since, "until": until, "topic": text("topic"), "key": text("key")}


def _bounded(conn: psycopg.Connection[Any], schema: str, chosen: data.DeadFilter) -> data.DeadFilter:
    """``chosen`` with this page's high-water mark: the one it came with, else the highest id now."""
    if chosen.high_water:
        return chosen
    return dataclasses.replace(chosen, high_water=data.high_water(conn, schema))


async def _action(request: Request) -> tuple[str, data.DeadFilter]:
    """A dead-letter action's form: the action, and the selector bounded by the page's mark."""
    form = await request.form()
    action = str(form.get("action", ""))
    if action not in data.ACTIONS:
        raise ConfigError(f"action: one of {', '.join(data.ACTIONS)}, got {action!r}")
    chosen = _filter(request, form)
    if not chosen.high_water:
        raise ConfigError("hw: the page's high-water mark is missing")
    return action, chosen


def _filter(request: Request, form: Any = None) -> data.DeadFilter:
    """The dead-letter filter of a query string or form (a form's high-water mark is the page's)."""
    src = form if form is not None else request.query_params

    def text(name: str) -> str | None:
        value = src.get(name)
        return value.strip() if isinstance(value, str) and value.strip() else None

    ids = tuple(int(v) for v in (src.getlist("id") if hasattr(src, "getlist") else []) if str(v).isdigit())
    hw = text("hw")
    return data.DeadFilter(
        high_water=int(hw) if hw and hw.isdigit() else 0,
        topic=text("topic"),
        key=text("key"),
        error=text("error"),
        since=_time(text("since"), "since"),
        until=_time(text("until"), "until"),
        fingerprint=text("fingerprint"),
        ids=ids,
    )


def app(
    dsn: str,
    *,
    schema: str = "outbox",
    read_only: bool = False,
    authorize: Authorize | None = None,
    hide_payloads: bool = False,
    trace_url: str | None = None,
) -> Starlette:
    """The console as an ASGI application, to run (``outbox console``) or to mount in your own.

    ``authorize(request)`` returns ``"write"``, ``"read"`` or None (refused). Without it every
    request may write: give one whenever the console is reachable by anyone else.
    """
    c = Console(
        dsn, schema, read_only=read_only, authorize=authorize, hide_payloads=hide_payloads,
        trace_url=trace_url,
    )  # fmt: skip

    def overview(request: Request) -> Response:
        level = c.access(request)
        if isinstance(level, Response):
            return level
        with c.conn() as conn:
            view = data.overview(conn, c.schema)
        partial = request.headers.get("hx-request") == "true"
        return c.page(request, "_overview.html" if partial else "overview.html", level, **view)

    def chart(request: Request) -> Response:
        level = c.access(request)
        if isinstance(level, Response):
            return level
        with c.conn() as conn:
            return JSONResponse(data.chart(conn, c.schema))

    def dead_letters(request: Request) -> Response:
        level = c.access(request)
        if isinstance(level, Response):
            return level
        event_id = request.query_params.get("event_id", "").strip()
        if event_id:
            found = request.url_for("event", event_id=event_id)
            key = request.query_params.get("key", "").strip()
            return RedirectResponse(
                str(found.include_query_params(key=key) if key else found), status_code=303
            )
        with c.conn() as conn:
            chosen = _bounded(conn, c.schema, _filter(request))
            groups = data.dead_groups(conn, c.schema, chosen)
        return c.page(
            request, "dead.html", level, groups=groups, chosen=chosen, done=request.query_params.get("done")
        )

    def dead_list(request: Request) -> Response:
        level = c.access(request)
        if isinstance(level, Response):
            return level
        with c.conn() as conn:
            chosen = _bounded(conn, c.schema, _filter(request))
            listed = data.dead_list(conn, c.schema, chosen)
        return c.page(request, "dead_list.html", level, chosen=chosen, limit=data.LIST_LIMIT, **listed)

    async def preview(request: Request) -> Response:
        level = c.access(request, write=True)
        if isinstance(level, Response):
            return level
        action, chosen = await _action(request)
        with c.conn() as conn:
            counts = data.preview(conn, c.schema, chosen)
        return c.page(
            request, "preview.html", level, action=action, chosen=chosen, counts=counts,
            command=command(action, chosen.audited()),
        )  # fmt: skip

    async def act(request: Request) -> Response:
        level = c.access(request, write=True)
        if isinstance(level, Response):
            return level
        action, chosen = await _action(request)
        with c.conn() as conn:
            n = data.act(conn, c.schema, action, chosen, _actor(request))
        url = request.url_for("dead_letters").include_query_params(done=f"{action}: {n} dead letters")
        return RedirectResponse(str(url), status_code=303)

    def key(request: Request) -> Response:
        level = c.access(request)
        if isinstance(level, Response):
            return level
        name = request.query_params.get("key", "")
        if not name:
            return PlainTextResponse("key: give the key (UTF-8 text, or 0x… for bytes)", status_code=400)
        with c.conn() as conn:
            view = data.timeline(conn, c.schema, name)
            hw = data.high_water(conn, c.schema)
        return c.page(request, "key.html", level, hw=hw, **view)

    def event(request: Request) -> Response:
        level = c.access(request)
        if isinstance(level, Response):
            return level
        event_id = request.path_params["event_id"]
        try:
            uuid.UUID(event_id)
        except ValueError:
            return PlainTextResponse(f"event id: not a UUID: {event_id!r}", status_code=400)
        key = request.query_params.get("key") or None
        scan = request.query_params.get("archive") == "scan"
        with c.conn() as conn:
            rows = data.event(conn, c.schema, event_id, key=key, scan=scan)
            hw = data.high_water(conn, c.schema)
        searched = {"key": key, "scan": scan}
        if not rows:
            return c.page(
                request, "event.html", level, rows=[], event_id=event_id, hw=hw, searched=searched,
                status_code=404,
            )  # fmt: skip
        for row in rows:
            row["view"] = _payload_view(row.pop("payload"))
            row["trace"] = c.trace_link(row["headers"])
        return c.page(
            request, "event.html", level, rows=rows, event_id=event_id, hw=hw, hide=c.hide_payloads,
            searched=searched,
        )  # fmt: skip

    def replay_form(request: Request) -> Response:
        level = c.access(request)
        if isinstance(level, Response):
            return level
        return c.page(request, "replay.html", level, window=_window(request.query_params), counts=None)

    async def replay_preview(request: Request) -> Response:
        level = c.access(request, write=True)
        if isinstance(level, Response):
            return level
        window = _window(await request.form())
        with c.conn() as conn:
            n = archive.replay_count(
                conn, c.schema, since=window["since"], until=window["until"], topic=window["topic"],
                key=key_bytes(window["key"], "key"),
            )  # fmt: skip
        chosen = {k: v.isoformat() if isinstance(v, dt.datetime) else v for k, v in window.items() if v}
        return c.page(
            request, "replay.html", level, window=window, counts=n, command=command("replay", chosen)
        )

    async def replay_act(request: Request) -> Response:
        level = c.access(request, write=True)
        if isinstance(level, Response):
            return level
        window = _window(await request.form())
        planned = int(str((await request.form()).get("planned", "0")) or 0)
        with c.conn() as conn:
            done = archive.replay_recorded(
                conn, c.schema, since=window["since"], until=window["until"], topic=window["topic"],
                key=window["key"], planned=planned, via="console", actor=_actor(request),
            )  # fmt: skip
        url = request.url_for("audit").include_query_params(done=f"replay: {done} events queued again")
        return RedirectResponse(str(url), status_code=303)

    def trail(request: Request) -> Response:
        level = c.access(request)
        if isinstance(level, Response):
            return level
        with c.conn() as conn:
            rows = data.trail(conn, c.schema)
        return c.page(request, "audit.html", level, rows=rows)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> Any:
        try:
            yield
        finally:
            c.pool.close()

    routes = [
        Route("/", overview, name="overview"),
        Route("/chart.json", chart, name="chart"),
        Route("/dead", dead_letters, name="dead_letters"),
        Route("/dead/list", dead_list, name="dead_list"),
        Route("/dead/preview", preview, methods=["POST"], name="preview"),
        Route("/dead/act", act, methods=["POST"], name="act"),
        Route("/key", key, name="key"),
        Route("/event/{event_id}", event, name="event"),
        Route("/audit", trail, name="audit"),
        Route("/replay", replay_form, name="replay"),
        Route("/replay/preview", replay_preview, methods=["POST"], name="replay_preview"),
        Route("/replay/act", replay_act, methods=["POST"], name="replay_act"),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]

    async def refused(request: Request, exc: Exception) -> Response:
        return PlainTextResponse(str(exc), status_code=400)  # bad input, named: a field and why

    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={OutboxError: refused})


def _actor(request: Request) -> str:
    """Who acts, for the audit trail: the basic-auth user, else the client's address."""
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() == "basic":
        try:
            return base64.b64decode(value).decode("utf-8", "replace").split(":", 1)[0] + " (console)"
        except (binascii.Error, ValueError):
            pass
    client = request.client.host if request.client else "unknown"
    return f"{client} (console)"
