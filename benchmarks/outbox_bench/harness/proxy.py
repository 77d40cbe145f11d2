"""A loopback TCP proxy that can take a server away: refuse it, or freeze it.

Put it between the relay and PostgreSQL or a broker to make network faults on
demand, on loopback only:

- ``refuse()``: every connection is reset and new ones are reset at once — the
  server is down, and says so (what a restart or a crash looks like);
- ``freeze()``: nothing moves in either direction, but every socket stays open
  and new connections are left waiting — a blackhole (a firewall dropping the
  flow, a node that vanished). Data sent meanwhile waits in the buffers;
- ``heal()``: traffic flows again (frozen bytes included).
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from dataclasses import dataclass, field

BUFFER = 65536  # bytes read at a time
TICK = 0.05  # seconds between looks at the mode when nothing happens


@dataclass
class _Pair:
    client: socket.socket
    upstream: socket.socket
    pending: dict[socket.socket, bytes] = field(default_factory=dict)  # bytes not yet written onward


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a dead server or a reset connection looks."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; ``refuse``/``freeze``/``heal`` change that."""

    def __init__(self, target_host: str, target_port: int, *, unix_path: str | None = None) -> None:
        """``unix_path``: forward to this Unix socket instead (a PostgreSQL on a socket dir)."""
        self.target = (target_host, target_port)
        self.unix_path = unix_path
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(128)
        self._listener.setblocking(False)
        self.port = int(self._listener.getsockname()[1])
        self.mode = "pass"
        self._pairs: list[_Pair] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="harness-proxy", daemon=True)
        self.connections = 0  # accepted so far

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Proxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for pair in self._pairs:
                _reset(pair.client)
                _reset(pair.upstream)
            self._pairs = []
        self._listener.close()

    def refuse(self) -> None:
        with self._lock:
            self.mode = "refuse"
            for pair in self._pairs:
                _reset(pair.client)
                _reset(pair.upstream)
            self._pairs = []

    def freeze(self) -> None:
        with self._lock:
            self.mode = "freeze"

    def heal(self) -> None:
        with self._lock:
            self.mode = "pass"

    def __enter__(self) -> Proxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the loop --------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except (BlockingIOError, OSError):
                return
            self.connections += 1
            if self.mode == "refuse":
                _reset(client)
                continue
            try:
                upstream = self._connect_upstream()
            except OSError:
                _reset(client)
                continue
            for s in (client, upstream):
                s.setblocking(False)
                if s.family != socket.AF_UNIX:
                    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._pairs.append(_Pair(client, upstream))

    def _connect_upstream(self) -> socket.socket:
        if self.unix_path is None:
            return socket.create_connection(self.target, timeout=5)
        upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        upstream.settimeout(5)
        try:
            upstream.connect(self.unix_path)
        except OSError:
            upstream.close()
            raise
        return upstream

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                mode = self.mode
                pairs = list(self._pairs)
            if mode == "freeze":
                # Leave new connections in the backlog and every byte where it is.
                self._stop.wait(TICK)
                continue
            selector = selectors.DefaultSelector()
            selector.register(self._listener, selectors.EVENT_READ, None)
            for pair in pairs:
                for sock in (pair.client, pair.upstream):
                    events = selectors.EVENT_READ | (selectors.EVENT_WRITE if sock in pair.pending else 0)
                    with contextlib.suppress(ValueError, OSError):
                        selector.register(sock, events, pair)
            for key, events in selector.select(TICK):
                if key.data is None:
                    self._accept()
                    continue
                self._move(key.data, key.fileobj, events)  # type: ignore[arg-type]
            selector.close()

    def _move(self, pair: _Pair, sock: socket.socket, events: int) -> None:
        other = pair.upstream if sock is pair.client else pair.client
        try:
            if events & selectors.EVENT_WRITE and sock in pair.pending:
                data = pair.pending.pop(sock)
                sent = sock.send(data)
                if sent < len(data):
                    pair.pending[sock] = data[sent:]
            if events & selectors.EVENT_READ and other not in pair.pending:
                data = sock.recv(BUFFER)
                if not data:
                    raise ConnectionResetError
                sent = other.send(data)
                if sent < len(data):
                    pair.pending[other] = data[sent:]
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            with self._lock:
                if pair in self._pairs:
                    self._pairs.remove(pair)
            _reset(pair.client)
            _reset(pair.upstream)
