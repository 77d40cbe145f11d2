"""The console over many outboxes (``outbox console --outbox/--schemas/--outboxes-file``).

- ``/``: the fleet page, one row per outbox (pending, oldest pending age, retrying, dead letters,
  parked keys, live relays, limits), sorted and filtered on the server, read with one pipelined
  round trip per database;
- ``/o/<name>/…``: each outbox's own pages (:func:`outbox.console.web.outbox_routes`), every
  action, preview and audit row scoped to that outbox's schema;
- ``/audit``: the latest actions of every outbox, newest first.

The outboxes of one database share one connection pool. An outbox's pages are built the first
time they are asked for: a thousand outboxes cost nothing until someone looks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any
from urllib.parse import unquote

import psycopg
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Receive, Scope, Send

from outbox.console.guards import Authorize, Guard, allowed_names
from outbox.console.web import (
    FLEET_ROOT,
    HERE,
    Console,
    new_pool,
    new_templates,
    outbox_routes,
    refused,
)
from outbox.errors import OutboxError
from outbox.operate import audit
from outbox.store import pinning
from outbox.store.outboxes import Outbox
from outbox.store.queries import query

SORTS = ("name", "pending", "oldest", "retrying", "dead", "parked", "relays")
AUDIT_ROWS = 100  # the fleet audit: the latest actions, of every outbox
PENDING_CAP = 100_000  # fleet_outbox_row counts pending events up to this
PREPARED_MAX = 20_000  # statements the fleet page's connection keeps prepared (one per outbox)


class Fleet:
    """The console's state over several outboxes: a pool per database, a console per outbox."""

    def __init__(self, outboxes: Sequence[Outbox], **options: Any) -> None:
        self.outboxes = {o.name: o for o in outboxes}
        self.options = options
        self.pools: dict[str, ConnectionPool[Any]] = {}
        for o in outboxes:
            if o.dsn not in self.pools:
                self.pools[o.dsn] = new_pool(o.dsn)
        self.templates = new_templates()
        self._consoles: dict[str, Console] = {}
        self._apps: dict[str, Starlette] = {}
        self._lock = threading.Lock()
        self._page_conns: dict[str, psycopg.Connection[Any]] = {}
        self._page_locks = {dsn: threading.Lock() for dsn in self.pools}
        # Each outbox's row statement, composed once: the statements' shared cache holds 512, and
        # at 1,000 outboxes composing them again at every request took a fifth of the page's time.
        self._row_statements: dict[str, bytes] = {}
        self.console = Console(  # the fleet pages' own (access, page rendering)
            outboxes[0].dsn, outboxes[0].schema, pool=self.pools[outboxes[0].dsn],
            templates=self.templates, **options,
        )  # fmt: skip

    def app_of(self, name: str) -> Starlette | None:
        """The pages of outbox ``name`` (built at the first request for them), or None."""
        o = self.outboxes.get(name)
        if o is None:
            return None
        with self._lock:
            if name not in self._apps:
                c = Console(
                    o.dsn,
                    o.schema,
                    pool=self.pools[o.dsn],
                    name=name,
                    templates=self.templates,
                    **self.options,
                )
                self._consoles[name] = c
                self._apps[name] = Starlette(
                    routes=outbox_routes(c), exception_handlers={OutboxError: refused}
                )
            return self._apps[name]

    def on(self, dsn: str, work: Callable[[psycopg.Connection[Any]], Any]) -> Any:
        pool = self.pools[dsn]
        pool.open(wait=False)
        with pool.connection() as conn:
            return work(conn)

    def by_database(self) -> dict[str, list[Outbox]]:
        out: dict[str, list[Outbox]] = {}
        for o in self.outboxes.values():
            out.setdefault(o.dsn, []).append(o)
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One row per outbox: one pipelined round trip per database, then its limits."""
        out: list[dict[str, Any]] = []
        for dsn, outboxes in self.by_database().items():
            try:
                with self._page_locks[dsn]:
                    out += _database_rows(self._page_conn(dsn), outboxes, self._row_statements)
            except psycopg.Error as exc:
                self._lose(dsn)
                out += [{"name": o.name, "error": f"cannot read: {type(exc).__name__}"} for o in outboxes]
        return out

    def _page_conn(self, dsn: str) -> psycopg.Connection[Any]:
        """The fleet page's own connection to a database, its statements prepared once: a row's
        statement names its outbox's schema, so a thousand outboxes are a thousand statements, too
        many to plan again at every request (decision 0013)."""
        conn = self._page_conns.get(dsn)
        if conn is None or conn.closed:
            conn = pinning.connect(dsn, autocommit=True, application_name="outbox-console")
            conn.prepare_threshold = 0
            conn.prepared_max = PREPARED_MAX
            self._page_conns[dsn] = conn
        return conn

    def _lose(self, dsn: str) -> None:
        conn = self._page_conns.pop(dsn, None)
        if conn is not None:
            conn.close()

    def trail(self) -> list[dict[str, Any]]:
        """The latest actions of every outbox, newest first."""
        rows: list[dict[str, Any]] = []
        for dsn, outboxes in self.by_database().items():
            try:
                rows += self.on(dsn, partial(_database_trail, outboxes=outboxes))
            except psycopg.Error:
                continue  # a database that cannot be read has no rows to show now
        rows.sort(key=lambda r: r["at"], reverse=True)
        return rows[:AUDIT_ROWS]

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
        for dsn in list(self._page_conns):
            self._lose(dsn)


def _database_trail(conn: psycopg.Connection[Any], outboxes: list[Outbox]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for o in outboxes:
        try:
            rows += [{**r, "outbox": o.name} for r in audit.recent(conn, o.schema, AUDIT_ROWS)]
        except psycopg.Error:
            continue  # this outbox's tables (dropped, say): the others still show
    return rows


def _database_rows(
    conn: psycopg.Connection[Any], outboxes: list[Outbox], statements: dict[str, bytes]
) -> list[dict[str, Any]]:
    for o in outboxes:
        if o.schema not in statements:
            statements[o.schema] = query("fleet_outbox_row", o.schema).as_bytes(conn)
    results: list[tuple[Outbox, Any]] = []
    try:
        with conn.pipeline():
            results = [(o, conn.execute(statements[o.schema])) for o in outboxes]
    except psycopg.Error:  # one outbox failed the pipeline (dropped, say): read each alone
        results = []
    rows: list[dict[str, Any]] = []
    if results:
        read = [(o, cur.fetchone()) for o, cur in results]
    else:
        read = []
        for o in outboxes:
            try:
                read.append((o, conn.execute(statements[o.schema]).fetchone()))
            except psycopg.Error as exc:
                rows.append({"name": o.name, "error": f"cannot read: {type(exc).__name__}"})
    limits: dict[str, list[dict[str, Any]]] = {}
    try:
        for schema, glob, spec, in_flight in conn.execute(query("fleet_limits", "public")):
            limits.setdefault(schema, []).append({"limit": f"{glob}={spec}", "in_flight": int(in_flight)})
    except psycopg.Error:
        pass  # no limit given yet, or an earlier version's outboxes: none shown
    for o, row in read:
        assert row is not None
        pending, oldest, retrying, dead, parked, relays = row
        rows.append(
            {
                "name": o.name,
                "schema": o.schema,
                "pending": int(pending),
                "capped": int(pending) >= PENDING_CAP,
                "oldest": None if oldest is None else float(oldest),
                "retrying": int(retrying),
                "dead": int(dead),
                "parked": int(parked),
                "relays": int(relays),
                "limits": limits.get(o.schema, []),
            }
        )
    return rows


def ordered(rows: list[dict[str, Any]], sort: str, desc: bool, find: str) -> list[dict[str, Any]]:
    """The rows whose name holds ``find``, sorted by ``sort`` (unreadable ones last)."""
    chosen = [r for r in rows if find.lower() in r["name"].lower()]
    good = [r for r in chosen if "error" not in r]
    bad = [r for r in chosen if "error" in r]
    if sort == "name":
        good.sort(key=lambda r: r["name"], reverse=desc)
    else:
        good.sort(key=lambda r: (r[sort] if r[sort] is not None else -1.0, r["name"]), reverse=desc)
    return good + sorted(bad, key=lambda r: r["name"])


class Outboxes:
    """``/o/<name>/…``: the request goes to that outbox's pages, mounted at ``/o/<name>`` (their
    links are made by their own routes, under that prefix)."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        root = scope.get("root_path", "")
        rest = scope["path"][len(root) :].lstrip("/")
        quoted, slash, _ = rest.partition("/")
        name = unquote(quoted)
        sub = self.fleet.app_of(name)
        if sub is None:
            await PlainTextResponse("no such outbox", status_code=404)(scope, receive, send)
            return
        if not slash:
            url = Request(scope).url
            await RedirectResponse(str(url.replace(path=url.path + "/")), status_code=307)(
                scope, receive, send
            )
            return
        prefix = f"{root}/{quoted}"
        child = {**scope, "root_path": prefix, "app_root_path": prefix, "router": sub.router}
        child[FLEET_ROOT] = root.removesuffix("/o") + "/"
        await sub(child, receive, send)


def app(
    outboxes: Sequence[Outbox],
    *,
    read_only: bool = False,
    authorize: Authorize | None = None,
    hide_payloads: bool = False,
    trace_url: str | None = None,
    allowed_hosts: Sequence[str] | None = None,
) -> Starlette:
    """The console over ``outboxes``: the fleet page, each outbox's pages under its name, and the
    fleet's audit (the options as for one outbox's: :func:`outbox.console.web.app`)."""
    if not outboxes:
        raise OutboxError("outboxes: none to show")
    fleet = Fleet(
        outboxes, read_only=read_only, authorize=authorize, hide_payloads=hide_payloads, trace_url=trace_url
    )
    c = fleet.console

    async def overview(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        params = request.query_params
        sort = params.get("sort", "pending")
        sort = sort if sort in SORTS else "pending"
        desc = params.get("order", "desc" if sort != "name" else "asc") == "desc"
        find = params.get("find", "")[:100]
        rows = await run_in_threadpool(fleet.rows)
        shown = ordered(rows, sort, desc, find)
        # Each row's link is this base and its name: url_for walks the routes at every call, which
        # for a thousand rows took the page longer than reading them.
        base = str(request.url_for("outbox", path="/"))
        return c.page(
            request, "fleet.html", who, rows=shown, total=len(rows), sort=sort, desc=desc, find=find,
            sorts=SORTS, totals=_totals(rows), fleet_page=True, outbox_base=base,
        )  # fmt: skip

    async def trail(request: Request) -> Response:
        who = c.access(request)
        if isinstance(who, Response):
            return who
        rows = await run_in_threadpool(fleet.trail)
        return c.page(request, "fleet_audit.html", who, rows=rows, total=len(fleet.outboxes), fleet_page=True)

    @asynccontextmanager
    async def lifespan(_: Starlette) -> Any:
        try:
            yield
        finally:
            fleet.close()

    routes = [
        Route("/", overview, name="fleet"),
        Route("/audit", trail, name="fleet_audit"),
        Mount("/o", app=Outboxes(fleet), name="outbox"),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={OutboxError: refused},
        middleware=[Middleware(Guard, names=allowed_names(allowed_hosts, authorize is not None))],
    )


def _totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    good = [r for r in rows if "error" not in r]
    return {k: sum(r[k] for r in good) for k in ("pending", "retrying", "dead", "parked")} | {
        "unreadable": len(rows) - len(good)
    }
