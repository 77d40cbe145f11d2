"""The console's guards: who may use it and as whom, under which host names and from which
origin, and the headers every response carries.

A web page in the operator's browser is not trusted (docs/security.md, "A web page"):

- **Host names.** A page at ``rebind.evil.example`` whose name the attacker points at
  127.0.0.1 (DNS rebinding) is same-origin with itself, so the browser lets it read the console
  and send its forms; only the ``Host`` header tells. The console answers only to the names it
  is served under: loopback names always, the names given (``--allowed-host``); an embedding
  application that gives ``authorize`` and no names checks hosts itself.
- **Origin.** A POST must come from a page of this console: ``Sec-Fetch-Site: same-origin``,
  else an ``Origin`` equal to the (checked) host; a client that sends neither is no browser.
- **Framing, sniffing, caching.** Every response forbids framing (``X-Frame-Options`` and CSP's
  ``frame-ancestors``), scripts from anywhere but the console, content sniffing, and storing it
  (pages show payloads).
- **Who.** ``authorize(request)`` says ``"write"``, ``"read"`` or None, or ``(level, identity)``;
  the audit trail's actor is that identity (the basic-auth user), else the client's address:
  never a header the console did not check.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import re
import urllib.parse
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# What authorize returns: a level, or a level and who the request is (for the audit trail).
Authorize = Callable[[Request], "str | tuple[str, str] | None"]
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
ANY_HOST = "*"
MAX_ACTOR_CHARS = 100
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
HEADERS = [
    (b"content-security-policy", CONTENT_SECURITY_POLICY.encode()),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


@dataclass(frozen=True)
class Visitor:
    """A request's access level and who it is, as the audit trail records it."""

    level: str
    actor: str


def basic_auth(user: str, password: str, *, level: str = "write") -> Authorize:
    """``authorize`` for the standalone console: HTTP basic with one user and password; the
    user is the audit trail's actor."""
    expected = f"{user}:{password}".encode()

    def authorize(request: Request) -> tuple[str, str] | None:
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        if scheme.lower() != "basic":
            return None
        try:
            given = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            return None
        return (level, user) if hmac.compare_digest(given, expected) else None

    authorize.basic = True  # type: ignore[attr-defined]  # 401s ask the browser for a password
    return authorize


def allow_all(request: Request) -> str | None:
    return "write"


def visitor(authorize: Authorize, request: Request) -> Visitor | None:
    """Who the request is, as ``authorize`` vouches for it; None: no access."""
    answer = authorize(request)
    identity: str | None = None
    if isinstance(answer, tuple):
        answer, identity = answer
    if answer not in ("read", "write"):
        return None
    if identity is None:
        identity = request.client.host if request.client else "unknown"
    shown = "".join(ch if ch.isprintable() else "?" for ch in str(identity))[:MAX_ACTOR_CHARS]
    return Visitor(str(answer), f"{shown} (console)")


def host_name(host: str) -> str:
    """The name of a ``Host`` header, without its port, in lower case (``[::1]:8000`` -> ``::1``)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def allowed_names(given: Iterable[str] | None, authorize_given: bool) -> frozenset[str] | None:
    """The host names served (None: any). Loopback names always; with no names given, only they,
    unless ``authorize`` is given (an embedding application checks its own hosts)."""
    if given is None:
        return None if authorize_given else LOOPBACK_NAMES
    names = {host_name(n) for n in given if n.strip()}
    return None if ANY_HOST in names else LOOPBACK_NAMES | names


def same_origin(request: Request) -> bool:
    """A state-changing request must come from a page of this console (or from no browser)."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site == "same-origin"
    origin = request.headers.get("origin")
    if origin is None:
        return True  # not a browser: curl, a script (authorization still applies)
    host = request.headers.get("host", "")
    return origin != "null" and urllib.parse.urlsplit(origin).netloc == host


class Guard:
    """ASGI middleware: refuses a request for a host name not served, and adds :data:`HEADERS`
    to every response."""

    def __init__(self, app: ASGIApp, names: frozenset[str] | None) -> None:
        self.app = app
        self.names = names

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.names is not None:
            host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.names:
                refused = PlainTextResponse(
                    "refused: this console is not served under that host name (outbox console "
                    "--allowed-host)",
                    status_code=421,
                    headers={k.decode(): v.decode() for k, v in HEADERS},
                )
                await refused(scope, receive, send)
                return

        async def guarded(message: Message) -> None:
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in HEADERS if k not in names]
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, guarded)


_QUOTED = re.compile(r"""(?<!\w)'(?:[^'\\]|\\.)*'(?!\w)|(?<!\w)"(?:[^"\\]|\\.)*"(?!\w)""")


def unquoted(text: str) -> str:
    """An error's text without the values it quotes (``got 'x'``): a page never shows what a
    query parameter said, since a link could make it say anything."""
    return _QUOTED.sub("…", text)
