"""A webhook receiver whose every answer is scripted, byte for byte: the fuzzer's door for a
sink's replies. Any status line (600, 99, a reason phrase with escape sequences), any header
(``Retry-After: ²``), any body (a NUL, a CR/LF and a forged log line), or a hang-up, per event and
per attempt.

Its own asyncio server writes the bytes as given: the harness's receiver answers with statuses
Python's ``HTTPStatus`` knows, and a well-formed response only.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections import Counter
from dataclasses import dataclass, field

from outbox_bench.harness.sinktaps import Request, read_request

_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


@dataclass(frozen=True)
class Reply:
    """One answer: ``hang_up`` closes the connection without a word; else a status line with
    ``status`` and ``phrase``, ``headers`` and ``body`` as they are."""

    status: int = 204
    phrase: bytes = b"OK"
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""
    hang_up: bool = False

    @property
    def accepts(self) -> bool:
        return not self.hang_up and 200 <= self.status < 300

    @property
    def clean(self) -> bool:
        """Well-formed: a status line or header holding a control character (a NUL, a lone CR)
        may be no HTTP response at all to the sender (aiohttp refuses one in a header, and takes
        one in the reason phrase), so its 2xx may or may not count as delivered. So is a 204 with a
        body, which HTTP forbids: the sender reads the body as the next response's status line."""
        if self.body and self.status in (204, 304):
            return False
        return not _CONTROL.search(self.phrase + b"".join(n + v for n, v in self.headers))

    def wire(self) -> bytes:
        head = [b"HTTP/1.1 %d %s" % (self.status, self.phrase), b"content-length: %d" % len(self.body)]
        head += [name + b": " + value for name, value in self.headers]
        return b"\r\n".join(head) + b"\r\n\r\n" + self.body


@dataclass
class Received:
    """A request the receiver answered with a 2xx: what the event delivered looks like."""

    event_id: str
    request: Request
    clean: bool  # a well-formed response (Reply.clean)


@dataclass
class ScriptedReceiver:
    """Answers the n-th request of an event (by its ``event-id`` header) with ``script[id][n]``
    (the last one again past the end); an event it has no script for gets a 204."""

    script: dict[str, list[Reply]] = field(default_factory=dict)
    attempts: Counter[str] = field(default_factory=Counter)
    accepted: list[Received] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()

        def serve() -> None:
            asyncio.set_event_loop(self._loop)
            self._server = self._loop.run_until_complete(
                asyncio.start_server(self._connection, "127.0.0.1", 0)
            )
            self.port = int(self._server.sockets[0].getsockname()[1])
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="fuzz-receiver", daemon=True)
        self._thread.start()
        ready.wait(10)

    def _answer(self, event_id: str) -> Reply:
        with self.lock:
            n = self.attempts[event_id]
            self.attempts[event_id] += 1
            replies = self.script.get(event_id) or [Reply()]
        return replies[min(n, len(replies) - 1)]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await read_request(reader)
                event_id = request.headers.get("event-id", "")
                reply = self._answer(event_id)
                if reply.hang_up:
                    break
                if reply.accepts:
                    with self.lock:
                        self.accepted.append(Received(event_id, request, reply.clean))
                writer.write(reply.wire())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, ValueError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            await self._server.wait_closed()
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        self._thread.join(5)
        self._loop.close()
