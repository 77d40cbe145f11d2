"""Redis Streams sink: ``redis://[:password@]host:port/db[?maxlen=N]`` (``outbox-relay[redis]``).

Client: redis-py's asyncio client (the Redis project's own). Each burst of
events is one pipeline of ``XADD`` commands (no transaction): one round trip
for up to 1,000 events.

- Stream: the event's topic.
- Fields: ``event-id``, ``key`` (absent when the key is null), ``payload``
  (the bytes) and ``headers`` (one JSON object, absent when there are none).
  A header value that is UTF-8 is a JSON string; one that is not is an object
  ``{"base64": "<the bytes in base64>"}``, so no value is ever altered.
- ``maxlen=N``: approximate trimming (``XADD … MAXLEN ~ N``).
- Delivered when the ``XADD`` reply arrives; the archive keeps the entry id
  (``sink_ref``).

Errors: ``WRONGTYPE`` (the key is not a stream) and ``NOPERM`` (an ACL refuses
it) -> dead; connection lost, ``OOM``, ``READONLY``, ``LOADING``, anything else
-> retry.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import redis.asyncio as aioredis
import redis.exceptions
from redis.asyncio.retry import Retry as ClientRetry
from redis.backoff import NoBackoff

from outbox.events import EVENT_ID_HEADER, ClaimedEvent
from outbox.sinks.aio import AsyncSink, Item, Unavailable, as_bytes
from outbox.sinks.base import Dead, Delivered, Outcome, Retry
from outbox.sinks.routes import SinkURL

PIPELINE = 1000  # XADDs per round trip, at most
DEAD_ERRORS = {"WRONGTYPE": "wrong_type", "NOPERM": "not_permitted"}


def headers_json(event: ClaimedEvent) -> str | None:
    """The event's headers as one JSON object (None when it has none)."""
    out: dict[str, Any] = {}
    for name, value in event.headers:
        if name == EVENT_ID_HEADER:  # a field of its own
            continue
        raw = as_bytes(value)
        try:
            out[name] = raw.decode("utf-8")
        except UnicodeDecodeError:
            out[name] = {"base64": base64.b64encode(raw).decode("ascii")}
    if not out:
        return None
    return json.dumps(out, separators=(",", ":"), ensure_ascii=False)


def fields(event: ClaimedEvent) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {"event-id": event.event_id}
    if event.key is not None:
        out["key"] = event.key
    out["payload"] = event.payload
    headers = headers_json(event)
    if headers is not None:
        out["headers"] = headers
    return out


class RedisSink(AsyncSink):
    scheme = "redis"

    def __init__(self, url: SinkURL, *, timeout: float) -> None:
        options = url.options
        self.maxlen = int(options["maxlen"]) if "maxlen" in options else None
        self._connect_url = url.parts._replace(query="").geturl()
        super().__init__(url, timeout=timeout)

    async def connect(self) -> Any:
        client = aioredis.Redis.from_url(
            self._connect_url,
            socket_connect_timeout=self.timeout,
            socket_timeout=self.timeout,
            retry=ClientRetry(NoBackoff(), 0),  # this sink retries, with its own backoff and log
        )
        try:
            await client.ping()
        except BaseException:
            await client.aclose()
            raise
        return client

    async def disconnect(self, conn: Any) -> None:
        await conn.aclose()

    async def reachable(self) -> None:
        await (await self.client()).ping()  # the client connects lazily: ask something

    def dispatch(self, items: list[Item]) -> None:
        for start in range(0, len(items), PIPELINE):
            self._loop.create_task(self._pipeline(items[start : start + PIPELINE]))

    async def _pipeline(self, items: list[Item]) -> None:
        outcomes = await self.attempt(self._xadd([event for event, _ in items]))
        if not isinstance(outcomes, list):  # the whole pipeline failed
            outcomes = [outcomes] * len(items)
        self.done_many(zip([report for _, report in items], outcomes, strict=True))

    async def _xadd(self, events: list[ClaimedEvent]) -> list[Outcome]:
        client = await self.client()
        pipe = client.pipeline(transaction=False)
        for event in events:
            pipe.xadd(event.topic, fields(event), maxlen=self.maxlen, approximate=True)
        try:
            replies = await pipe.execute(raise_on_error=False)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            if client is self._conn:
                self.lost(f"connection lost: {self.clean(exc)}")
            raise Unavailable(f"{self.name}: {self.clean(exc)}") from None
        outcomes = [self._outcome(reply) for reply in replies]
        self.confirmed()
        return outcomes

    def _outcome(self, reply: Any) -> Outcome:
        if isinstance(reply, bytes):
            return Delivered(None, None, reply.decode("ascii"))
        if isinstance(reply, str):
            return Delivered(None, None, reply)
        text = self.clean(reply) if isinstance(reply, BaseException) else repr(reply)
        code = text.split(" ", 1)[0]
        if code in DEAD_ERRORS:
            return Dead(DEAD_ERRORS[code], f"{self.name}: {text}")
        return Retry(code.lower() if code.isupper() else type(reply).__name__, f"{self.name}: {text}")

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]:
        return f"XADD {topic}", {
            "db.system.name": "redis",
            "db.system": "redis",
            "db.operation.name": "XADD",
            "db.collection.name": topic,
            "db.namespace": self.url.parts.path.strip("/") or "0",
            "server.address": self.url.parts.hostname or "",
            "server.port": self.url.parts.port or 6379,
        }
