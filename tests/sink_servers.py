"""The real sink servers under test: a destination of its own per test, and a way to read it back.

RabbitMQ (127.0.0.1:5672), NATS JetStream (127.0.0.1:4222) and Redis (127.0.0.1:6379) are the
machine's servers (``.ci/run`` starts any that is down); webhooks go to a receiver this module
starts on a free loopback port. Each :class:`Target` gives a route URL for one test's own
exchange / stream / key prefix / path, a topic that lands there, and ``read`` to get back what
arrived as :class:`tests.helpers.Message` (in arrival order; ``partition`` 0, ``offset`` the
position).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import aiormq
import nats
import redis
from outbox_bench.harness.sinktaps import Receiver, Request

from tests.helpers import Message

RABBIT = ("127.0.0.1", 5672)
NATS = ("127.0.0.1", 4222)
REDIS = ("127.0.0.1", 6379)
SINKS = ("amqp", "nats", "redis", "http")


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


class Target:
    """One test's destination on one sink."""

    scheme = ""
    topic = ""

    def url(self, host: str | None = None, port: int | None = None) -> str:
        """The route URL; ``host``/``port`` replace the server's (to go through a proxy)."""
        raise NotImplementedError

    @property
    def server(self) -> tuple[str, int]:
        raise NotImplementedError

    def read(self, expected: int, timeout: float = 30.0) -> list[Message]:
        """Everything that arrived, once at least ``expected`` messages did (AssertionError if not)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.fetch()
            if len(got) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        if len(got) < expected:
            raise AssertionError(f"{self.scheme}: read {len(got)} messages, expected {expected}")
        return got

    def fetch(self) -> list[Message]:
        raise NotImplementedError

    def close(self) -> None:
        pass


class RabbitTarget(Target):
    """An exchange of its own, and a queue bound to it with ``#`` that records everything."""

    scheme = "amqp"

    def __init__(self) -> None:
        self.exchange = f"x-{uuid.uuid4().hex[:10]}"
        self.queue = f"q-{uuid.uuid4().hex[:10]}"
        self.topic = "orders.created"
        self._got: list[Message] = []
        _run(self._setup())

    @property
    def server(self) -> tuple[str, int]:
        return RABBIT

    def url(self, host: str | None = None, port: int | None = None) -> str:
        return f"amqp://guest:guest@{host or RABBIT[0]}:{port or RABBIT[1]}/?exchange={self.exchange}"

    async def _setup(self) -> None:
        conn = await aiormq.connect(f"amqp://guest:guest@{RABBIT[0]}:{RABBIT[1]}/")
        ch = await conn.channel()
        await ch.exchange_declare(self.exchange, exchange_type="topic", durable=True)
        await ch.queue_declare(self.queue, durable=True)
        await ch.queue_bind(self.queue, self.exchange, routing_key="#")
        await conn.close()

    async def _drain(self) -> None:
        conn = await aiormq.connect(f"amqp://guest:guest@{RABBIT[0]}:{RABBIT[1]}/")
        ch = await conn.channel()
        while True:
            msg = await ch.basic_get(self.queue, no_ack=True)
            if msg.delivery_tag is None or not hasattr(msg.delivery, "routing_key"):
                break
            props = msg.header.properties
            headers = {
                k: (v.encode() if isinstance(v, str) else bytes(v)) for k, v in (props.headers or {}).items()
            }
            key = headers.pop("event-key", None)
            headers["x-message-id"] = (props.message_id or "").encode()
            headers["x-content-type"] = (props.content_type or "").encode()
            headers["x-delivery-mode"] = str(props.delivery_mode).encode()
            headers["x-routing-key"] = msg.delivery.routing_key.encode()
            self._got.append(Message(key, bytes(msg.body), headers, 0, len(self._got)))
        await conn.close()

    def fetch(self) -> list[Message]:
        _run(self._drain())
        return list(self._got)

    def close(self) -> None:
        async def teardown() -> None:
            conn = await aiormq.connect(f"amqp://guest:guest@{RABBIT[0]}:{RABBIT[1]}/")
            ch = await conn.channel()
            await ch.queue_delete(self.queue)
            await ch.exchange_delete(self.exchange)
            await conn.close()

        _run(teardown())


class NatsTarget(Target):
    """A JetStream stream of its own taking ``<prefix>.>``."""

    scheme = "nats"

    def __init__(self) -> None:
        prefix = f"p{uuid.uuid4().hex[:10]}"
        self.stream = prefix.upper()
        self.topic = f"{prefix}.orders"
        self.subjects = [f"{prefix}.>"]
        _run(self._setup())

    @property
    def server(self) -> tuple[str, int]:
        return NATS

    def url(self, host: str | None = None, port: int | None = None) -> str:
        return f"nats://{host or NATS[0]}:{port or NATS[1]}"

    async def _setup(self) -> None:
        nc = await nats.connect(self.url())
        await nc.jetstream().add_stream(name=self.stream, subjects=self.subjects)
        await nc.close()

    async def _all(self) -> list[Message]:
        nc = await nats.connect(self.url())
        js = nc.jetstream()
        info = await js.stream_info(self.stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1):
            msg = await js.get_msg(self.stream, seq)
            headers = {k: v.encode() for k, v in (msg.headers or {}).items()}
            key = headers.pop("event-key", None)
            headers["x-subject"] = (msg.subject or "").encode()
            out.append(Message(key, msg.data or b"", headers, 0, seq))
        await nc.close()
        return out

    def fetch(self) -> list[Message]:
        return list(_run(self._all()))

    def close(self) -> None:
        async def teardown() -> None:
            nc = await nats.connect(self.url())
            await nc.jetstream().delete_stream(self.stream)
            await nc.close()

        _run(teardown())


class RedisTarget(Target):
    """A stream named after a topic of its own."""

    scheme = "redis"

    def __init__(self) -> None:
        self.topic = f"t-{uuid.uuid4().hex[:10]}"
        self._client = redis.Redis(host=REDIS[0], port=REDIS[1])

    @property
    def server(self) -> tuple[str, int]:
        return REDIS

    def url(self, host: str | None = None, port: int | None = None) -> str:
        return f"redis://{host or REDIS[0]}:{port or REDIS[1]}/0"

    def fetch(self) -> list[Message]:
        out = []
        for entry_id, fields in self._client.xrange(self.topic):
            headers: dict[str, bytes] = {"event-id": fields[b"event-id"], "x-entry-id": entry_id}
            for name, value in json.loads(fields.get(b"headers", b"{}")).items():
                headers[name] = value.encode() if isinstance(value, str) else value
            out.append(Message(fields.get(b"key"), fields[b"payload"], headers, 0, len(out)))
        return out

    def close(self) -> None:
        self._client.delete(self.topic, self.topic + "-refused")
        self._client.close()


class HttpTarget(Target):
    """A path of its own on a receiver started for the test; 2xx (delivered) requests are read."""

    scheme = "http"

    def __init__(self, receiver: Receiver | None = None) -> None:
        self.receiver = receiver or Receiver()
        self.path = f"/hooks/{uuid.uuid4().hex[:10]}"
        self.topic = "orders.created"
        self.accepted: list[Request] = []
        inner = self.receiver.respond

        def recording(request: Request) -> tuple[int, dict[str, str], bytes]:
            answer = self.decide(request) if self.decide else inner(request)
            if 200 <= answer[0] < 300 and request.method == "POST":  # not the relay's probes
                with self.receiver.lock:
                    self.accepted.append(request)
            return answer

        self.decide: Callable[[Request], tuple[int, dict[str, str], bytes]] | None = None
        self.receiver.respond = recording

    @property
    def server(self) -> tuple[str, int]:
        return ("127.0.0.1", self.receiver.port)

    def url(self, host: str | None = None, port: int | None = None) -> str:
        return f"http://{host or '127.0.0.1'}:{port or self.receiver.port}{self.path}/{{topic}}/{{key}}"

    def fetch(self) -> list[Message]:
        with self.receiver.lock:
            accepted = list(self.accepted)
        out = []
        for r in accepted:
            headers = {k: v.encode("latin-1") for k, v in r.headers.items()}
            key = headers.pop("event-key", None)
            headers["x-path"] = r.path.encode()
            out.append(Message(key, r.body, headers, 0, len(out)))
        return out

    def close(self) -> None:
        self.receiver.close()


def target(scheme: str) -> Target:
    return {"amqp": RabbitTarget, "nats": NatsTarget, "redis": RedisTarget, "http": HttpTarget}[scheme]()


def targets_of(scheme: str) -> Iterator[Target]:
    t = target(scheme)
    try:
        yield t
    finally:
        t.close()
