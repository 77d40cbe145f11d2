"""Webhook sink: ``http(s)://…`` with ``{topic}`` / ``{key}`` (``outbox-relay[http]``), signed.

Client: aiohttp's ClientSession: a pool of keep-alive connections (HTTP/1.1),
one ``POST`` per event, many requests at once across keys (per-key order: one
at a time per key, :mod:`outbox.sinks.chains`). TLS is verified; redirects are
not followed. (Not httpx: its async pool slows down as requests run
concurrently, decision 0013.)

Request:

- URL: the route's, with ``{topic}`` and ``{key}`` replaced, URL-encoded (a null
  key is empty; a key that is not UTF-8 is percent-encoded byte by byte).
- Body: the payload bytes. ``content-type``: the event's, else
  ``application/octet-stream``.
- Standard Webhooks signature: ``webhook-id`` = event id, ``webhook-timestamp``
  = Unix seconds, ``webhook-signature`` = ``v1,<base64 HMAC-SHA256 of
  "<id>.<timestamp>.<body>">`` under each secret of the event's topic: the first
  ``--webhook-secret-env GLOB=VARIABLE`` whose glob matches it, else ``--webhook-secret`` /
  ``OUTBOX_WEBHOOK_SECRET`` (``whsec_<base64>``, space-separated for rotation: one
  signature per secret). A secret per receiver keeps one receiver from forging requests to
  another. Without a secret, requests are not signed.
- The event's headers are a writer's, and a receiver (or a proxy before it) acts on many HTTP
  header names: ``Authorization``, ``Cookie``, ``Host``, ``X-Original-URL``, ``Transfer-Encoding``.
  So only trace context (``traceparent``, ``tracestate``, ``baggage``), ``event-id``,
  ``event-key`` (the key), the relay's ``outbox-claim-check`` and the CloudEvents binding's
  ``ce-*`` go under their own names;
  every other event header goes as ``event-header-<name>``. A value that is not one line of
  UTF-8 text cannot be an HTTP header: that event is dead-lettered (``invalid_header``).
- ``{topic}`` and ``{key}`` are percent-encoded, ``/`` included; a value that would be a
  ``.`` or ``..`` path segment on a receiver that decodes it (``..``, ``a/../b``, ``%2e%2e``)
  is dead-lettered (``invalid_topic`` / ``invalid_key``): it would move the request's path.

Response: 2xx delivered; 408, 425, 429, 5xx, timeouts and connection errors
retried (``Retry-After`` honoured, up to the retry cap); any other status (3xx
included) dead, with the status and the first 200 bytes of the body.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import deque
from collections.abc import Sequence
from email.utils import parsedate_to_datetime
from fnmatch import fnmatchcase
from typing import Any
from urllib.parse import quote, unquote_to_bytes

import aiohttp
from yarl import URL

from outbox.events import ClaimedEvent
from outbox.sinks.aio import AsyncSink, Item, Refused, Unavailable, as_bytes, text_headers
from outbox.sinks.base import Delivered, Outcome, Retry
from outbox.sinks.routes import SinkURL
from outbox.sinks.signing import signature

RETRIED_STATUSES = frozenset({408, 425, 429})
BODY_KEPT = 200  # bytes of a refusing response's body kept in the dead letter
MAX_CONNECTIONS = 100  # concurrent requests per endpoint host, at most
# Event headers sent under their own names (lower case); every other one is renamed.
FORWARDED = frozenset({"traceparent", "tracestate", "baggage", "event-id", "event-key", "outbox-claim-check"})
FORWARDED_PREFIX = "ce-"  # the CloudEvents HTTP binding's attributes and extensions
RENAMED_PREFIX = "event-header-"
_SEGMENTS = re.compile(rb"[/\\]")


def request_headers(headers: dict[str, str]) -> dict[str, str]:
    """An event's text headers as the request's: the forwarded names as they are, the rest
    under :data:`RENAMED_PREFIX`; ``content-type`` is set apart (the body's type)."""
    out: dict[str, str] = {}
    for name, value in headers.items():
        lower = name.lower()
        if lower in FORWARDED or lower.startswith(FORWARDED_PREFIX):
            out[name] = value
        elif lower != "content-type":
            out[RENAMED_PREFIX + name] = value
    return out


def moves_path(value: bytes) -> bool:
    """Would ``value``, put into a URL path, be or hold a ``.``/``..`` segment on a receiver that
    decodes it (once, or once more)? Such a segment moves the request to another path."""
    for text in (value, unquote_to_bytes(value)):
        if any(segment in (b".", b"..") for segment in _SEGMENTS.split(text)):
            return True
    return False


def path_value(value: bytes, field: str) -> str:
    """``value`` percent-encoded for a path, ``/`` included; Refused if it would move the path."""
    if moves_path(value):
        raise Refused(
            f"invalid_{field}",
            f"the {field} {value[:100]!r} would be a '.' or '..' segment of the webhook URL's path",
        )
    return quote(value, safe="")


def retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date), or None."""
    if not value:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # "²" and "٣" are digits to str.isdigit, not to float()
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, OverflowError):  # a receiver's header: anything at all
        return None


class WebhookSink(AsyncSink):
    scheme = "http"

    def __init__(
        self,
        url: SinkURL,
        *,
        timeout: float,
        secrets: list[bytes],
        secrets_for: Sequence[tuple[str, list[bytes]]] = (),
    ) -> None:
        self._template = url.text
        self._keys = secrets  # for topics no glob of secrets_for matches
        self._keys_for = list(secrets_for)  # (topic glob, secrets), first match wins
        self._topic_keys: dict[str, list[bytes]] = {}
        self._templated = "{topic}" in url.text or "{key}" in url.text
        self._session: aiohttp.ClientSession | None = None
        self._fixed_url = None if self._templated else URL(url.text, encoded=True)
        self._waiting: deque[Item] = deque()  # sent, not yet started (loop thread)
        self._workers = 0
        super().__init__(url, timeout=timeout)

    def _client_session(self) -> aiohttp.ClientSession:
        """The session, made on the loop's thread at first use (aiohttp binds it to the loop)."""
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=MAX_CONNECTIONS),  # TLS verified by default
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                auto_decompress=False,
            )
        return self._session

    def dispatch(self, items: list[Item]) -> None:
        """Queue the burst for at most :data:`MAX_CONNECTIONS` workers, one request each at a
        time: no task per event, and no queue of waiters inside aiohttp's connection pool
        (with thousands of requests started at once, that queue costs more than the requests).
        Each request is bounded by the session's timeout."""
        self._waiting.extend(items)
        start = min(MAX_CONNECTIONS - self._workers, len(self._waiting))
        for _ in range(start):
            self._workers += 1
            self._loop.create_task(self._work())

    async def _work(self) -> None:
        waiting = self._waiting
        try:
            while waiting:
                await self.send_one(*waiting.popleft())
        finally:
            self._workers -= 1

    async def reachable(self) -> None:
        """The probe while the receiver counts as down: an unsigned ``OPTIONS`` request with no
        body to the route's URL (its origin when the URL is a template). Any HTTP answer, 405 or
        401 included, means the receiver is back; no answer within the timeout, it is not."""
        url = self._fixed_url or URL(self._template, encoded=True).origin()
        async with self._client_session().options(url, allow_redirects=False) as response:
            await response.release()

    def target(self, event: ClaimedEvent) -> str:
        if not self._templated:
            return self._template
        key = "" if event.key is None else path_value(event.key, "key")
        topic = path_value(event.topic.encode(), "topic")
        return self._template.replace("{topic}", topic).replace("{key}", key)

    def keys(self, topic: str) -> list[bytes]:
        """The signing secrets of ``topic``'s events."""
        keys = self._topic_keys.get(topic)
        if keys is None:
            keys = next((k for glob, k in self._keys_for if fnmatchcase(topic, glob)), self._keys)
            if len(self._topic_keys) < 10_000:
                self._topic_keys[topic] = keys
        return keys

    async def deliver(self, event: ClaimedEvent) -> Outcome:
        url = self._fixed_url or URL(self.target(event), encoded=True)
        headers = request_headers(text_headers(event))
        content_type = next((v for k, v in event.headers if k.lower() == "content-type"), None)
        headers["content-type"] = (
            as_bytes(content_type).decode("latin-1") if content_type else "application/octet-stream"
        )
        keys = self.keys(event.topic) if self._keys_for else self._keys
        if keys:
            now = int(time.time())
            headers["webhook-id"] = event.event_id
            headers["webhook-timestamp"] = str(now)
            headers["webhook-signature"] = signature(keys, event.event_id, now, event.payload)
        session = self._client_session()
        try:
            async with session.post(
                url,
                data=event.payload,
                headers=headers,
                allow_redirects=False,
            ) as response:
                status = response.status
                if 200 <= status < 300:
                    self.confirmed()
                    return Delivered()
                body = (await response.content.read(BODY_KEPT)).decode("utf-8", "replace")
                wait = retry_after(response.headers.get("retry-after"))
        except asyncio.TimeoutError:
            self.timed_out()
            return Retry("timeout", f"{self.name} did not answer within {self.timeout:g} s")
        except (aiohttp.ClientError, OSError) as exc:
            why = f"{type(exc).__name__}: {self.clean(exc)}"
            self.condition.fail(why)
            raise Unavailable(f"cannot reach {self.name}: {why}") from None
        self.confirmed()  # it answered: reachable, whatever it said
        reason = f"HTTP {status} from {self.name}: {body}"
        if status in RETRIED_STATUSES or status >= 500:
            return Retry(f"http_{status}", reason, wait)
        raise Refused(f"http_{status}", reason)

    async def _shutdown(self) -> None:
        await super()._shutdown()
        if self._session is not None:
            await self._session.close()

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]:
        parts = self.url.parts
        return "POST", {
            "http.request.method": "POST",
            "url.full": self.name,  # without credentials or query
            "server.address": parts.hostname or "",
            "server.port": parts.port or (443 if self.url.scheme == "https" else 80),
        }
