"""What a sink other than Kafka received, read back like :class:`outbox.harness.tap.Tap` reads Kafka.

``outbox bench faults --sink URL`` runs its scenarios against RabbitMQ, NATS JetStream,
Redis Streams or webhooks. Each tap makes the run's own destination, gives the route the
relays use, and records every message that arrives (event id, the load's key and
sequence, arrival time, and its position in the sink: queue order, stream sequence,
entry order, request order) — the same :class:`~outbox.harness.tap.Seen` records the
fault tally judges.

- ``amqp://…``: an exchange ``faults-<tag>`` and a queue bound to it with ``#``, consumed;
- ``nats://…``: a stream taking the run's topic, read by an ordered consumer;
- ``redis://…``: the stream named after the topic, read with ``XREAD``;
- ``http``: a receiver of the harness's own on a free loopback port;
- ``sqs://``, ``sns://``, ``eventbridge://``, ``kinesis://`` with ``?endpoint=``:
  :mod:`outbox_bench.harness.awstap`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any
from urllib.parse import urlsplit

from outbox.harness.load import decode
from outbox.harness.tap import Seen


class SinkTap(threading.Thread):
    """Records what arrived at one sink destination until ``stop_event`` is set."""

    scheme = ""
    may_skip = False  # its live read can miss a record that a sweep (a read from the start) finds

    def __init__(self, url: str, topic: str) -> None:
        super().__init__(name=f"harness-tap-{self.scheme}", daemon=True)
        self.url, self.topic = url, topic
        parts = urlsplit(url)
        self.server = (parts.hostname or "127.0.0.1", parts.port or 0)
        self.seen: list[Seen] = []
        self.first_seen: dict[str, float] = {}
        self.stop_event = threading.Event()
        self.ready = threading.Event()
        self.lock = threading.Lock()
        self.gaps = 0
        self.generation = 0
        self.found_by_reread = 0

    def record(self, event_id: str, value: bytes, position: int) -> None:
        key, seq = decode(value)
        now = time.time()
        with self.lock:
            self.seen.append(Seen(event_id, key, seq, now, (0, 0, position)))
            self.first_seen.setdefault(event_id, now)

    def route(self, host: str, port: int) -> str:
        """The route URL through ``host:port`` (a proxy in front of the server)."""
        parts = urlsplit(self.url)
        netloc = f"{parts.username}:{parts.password}@" if parts.password else ""
        return parts._replace(netloc=f"{netloc}{host}:{port}").geturl()

    def count(self) -> int:
        with self.lock:
            return len(self.first_seen)

    def reset(self) -> None:
        return None

    def sweep(self) -> int:
        return 0

    def caught_up(self, timeout: float) -> bool:
        return True

    def setup(self) -> None:
        return None

    def teardown(self) -> None:
        return None

    def run(self) -> None:
        asyncio.run(self.read())

    async def read(self) -> None:
        raise NotImplementedError


class RabbitTap(SinkTap):
    scheme = "amqp"

    def __init__(self, url: str, topic: str) -> None:
        tag = uuid.uuid4().hex[:8]
        self.exchange, self.queue = f"faults-{tag}", f"faults-{tag}"
        parts = urlsplit(url)
        super().__init__(parts._replace(query=f"exchange={self.exchange}").geturl(), topic)
        self._base = parts._replace(query="").geturl()

    async def _channel(self) -> Any:
        import aiormq

        conn = await aiormq.connect(self._base)
        return conn, await conn.channel()

    def setup(self) -> None:
        async def declare() -> None:
            conn, ch = await self._channel()
            await ch.exchange_declare(self.exchange, exchange_type="topic", durable=True)
            await ch.queue_declare(self.queue, durable=True)
            await ch.queue_bind(self.queue, self.exchange, routing_key="#")
            await conn.close()

        asyncio.run(declare())

    async def read(self) -> None:
        conn, ch = await self._channel()
        position = [0]

        async def on_message(msg: Any) -> None:
            props = msg.header.properties
            position[0] += 1
            self.record(props.message_id or "", bytes(msg.body), position[0])

        await ch.basic_qos(prefetch_count=1000)
        await ch.basic_consume(self.queue, on_message, no_ack=True)
        self.ready.set()
        while not self.stop_event.is_set():
            await asyncio.sleep(0.1)
        await conn.close()

    def teardown(self) -> None:
        async def drop() -> None:
            conn, ch = await self._channel()
            await ch.queue_delete(self.queue)
            await ch.exchange_delete(self.exchange)
            await conn.close()

        asyncio.run(drop())


class NatsTap(SinkTap):
    scheme = "nats"

    def __init__(self, url: str, topic: str) -> None:
        super().__init__(url, topic)
        self.stream = "FAULTS_" + uuid.uuid4().hex[:8].upper()

    def setup(self) -> None:
        import nats

        async def create() -> None:
            nc = await nats.connect(self.url)
            await nc.jetstream().add_stream(name=self.stream, subjects=[self.topic])
            await nc.close()

        asyncio.run(create())

    async def read(self) -> None:
        import nats

        nc = await nats.connect(self.url)

        async def on_message(msg: Any) -> None:
            self.record((msg.headers or {}).get("event-id", ""), msg.data, msg.metadata.sequence.stream)

        await nc.jetstream().subscribe(self.topic, cb=on_message, ordered_consumer=True)
        self.ready.set()
        while not self.stop_event.is_set():
            await asyncio.sleep(0.1)
        await nc.close()

    def teardown(self) -> None:
        import nats

        async def drop() -> None:
            nc = await nats.connect(self.url)
            await nc.jetstream().delete_stream(self.stream)
            await nc.close()

        asyncio.run(drop())


class RedisTap(SinkTap):
    scheme = "redis"

    def _client(self) -> Any:
        import redis

        return redis.Redis.from_url(urlsplit(self.url)._replace(query="").geturl())

    async def read(self) -> None:
        client = self._client()
        last, position = "0-0", 0
        self.ready.set()
        while not self.stop_event.is_set():
            try:
                reply = await asyncio.to_thread(client.xread, {self.topic: last}, 1000, 200)
            except Exception:  # the server away during a fault: read again
                await asyncio.sleep(0.2)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    position += 1
                    last = entry_id.decode()
                    self.record(fields[b"event-id"].decode(), fields[b"payload"], position)
        client.close()

    def sweep(self) -> int:
        client = self._client()
        added = 0
        try:
            for position, (_, fields) in enumerate(client.xrange(self.topic), 1):
                event_id = fields[b"event-id"].decode()
                with self.lock:
                    known = event_id in self.first_seen
                if not known:
                    self.record(event_id, fields[b"payload"], position)
                    added += 1
        finally:
            client.close()
        self.found_by_reread += added
        return added

    def teardown(self) -> None:
        client = self._client()
        client.delete(self.topic)
        client.close()


@dataclass
class Request:
    path: str
    headers: dict[str, str]
    body: bytes
    method: str = "POST"


async def read_request(reader: asyncio.StreamReader) -> Request:
    """One HTTP/1.1 request off ``reader``: its line, its headers (names in lower case) and its
    Content-Length body. IncompleteReadError when the peer is gone."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    method, path = lines[0].split(" ")[:2]
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return Request(path, headers, body, method)


@dataclass
class Receiver:
    """A webhook receiver on a free loopback port. ``respond(request) -> (status, headers, body)``
    decides each answer (default 204); every request is kept in ``requests``.

    An asyncio HTTP/1.1 server (keep-alive, Content-Length bodies) on its own loop in a daemon
    thread: Python's http.server answers a few hundred requests a second and resets
    connections beyond a backlog of five, which would measure the receiver, not the relay.
    """

    respond: Callable[[Request], tuple[int, dict[str, str], bytes]] = lambda r: (204, {}, b"")
    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    keep: bool = True  # keep every request in ``requests``

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="harness-receiver", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0, backlog=1024)
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._ready.set()
        self._loop.run_forever()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                if self.keep:
                    with self.lock:
                        self.requests.append(request)
                status, extra, reply = self.respond(request)
                out = [f"HTTP/1.1 {status} {HTTPStatus(status).phrase}", f"content-length: {len(reply)}"]
                out += [f"{k}: {v}" for k, v in extra.items()]
                writer.write(("\r\n".join(out) + "\r\n\r\n").encode("latin-1") + reply)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, IndexError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        if self._loop.is_closed():
            return

        def stop() -> None:
            self._server.close()
            self._loop.stop()

        self._loop.call_soon_threadsafe(stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.run_until_complete(self._server.wait_closed())
            self._loop.close()


class Clocked:
    """A webhook receiver that notes when each request came (monotonic): the limits scenario's and
    its tests' measure of a rate at the receiver."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.lock = threading.Lock()
        self.receiver = Receiver(respond=self._note, keep=False)
        self.url = f"http://127.0.0.1:{self.receiver.port}/hook"

    def _note(self, request: Request) -> tuple[int, dict[str, str], bytes]:
        if request.method == "POST":
            with self.lock:
                self.times.append(time.monotonic())
        return 204, {}, b""

    def rate(self, first: int, last: int, full_after: float | None = None) -> float:
        """Requests a second between the ``first``-th and the ``last``-th (0 when there are not
        that many, or they came at once). With ``full_after`` (a bucket's burst, in seconds of its
        rate), a silence longer than that counts only that long: the relays (or the receiver)
        were stalled past the burst, the bucket was full, and the tokens of the rest of it were
        not kept, by design (a rate is a ceiling, not a quota to catch up on)."""
        with self.lock:
            times = sorted(self.times)
        if not first < last < len(times) or times[last] <= times[first]:
            return 0.0
        span = times[last] - times[first]
        if full_after is not None:
            span -= self.stalled(first, last, full_after)
        return (last - first) / span

    def stalled(self, first: int, last: int, full_after: float) -> float:
        """Seconds of silences between the ``first``-th and the ``last``-th request beyond
        ``full_after`` each."""
        with self.lock:
            times = sorted(self.times)
        gaps = (b - a for a, b in itertools.pairwise(times[first : last + 1]))
        return sum(max(0.0, g - full_after) for g in gaps)


class HttpTap(SinkTap):
    scheme = "http"

    def __init__(self, url: str, topic: str) -> None:
        self.position = 0
        self.receiver = Receiver(respond=self._accept)
        super().__init__(f"http://127.0.0.1:{self.receiver.port}/faults/{{topic}}", topic)

    def _accept(self, request: Request) -> tuple[int, dict[str, str], bytes]:
        if request.method != "POST":  # the relay's probe while the receiver counts as down
            return 204, {}, b""
        with self.lock:
            self.position += 1
            position = self.position
        self.record(request.headers.get("event-id", ""), request.body, position)
        return 204, {}, b""

    async def read(self) -> None:
        self.ready.set()
        while not self.stop_event.is_set():
            await asyncio.sleep(0.1)

    def teardown(self) -> None:
        self.receiver.close()
