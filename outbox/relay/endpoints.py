"""``/metrics``, ``/livez`` and ``/readyz``: ``/livez`` says the process is alive; ``/readyz``
says the relay can do its job (database reachable, sinks healthy, every outbox served, not
draining for shutdown), from :class:`outbox.observe.readiness.Readiness`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from outbox.relay.gauges import DatabaseGauges
from outbox.relay.metrics import RelayMetrics

if TYPE_CHECKING:
    from outbox.observe.readiness import Readiness


class HealthServer:
    """``/metrics``, ``/livez``, ``/readyz`` on ``host:port`` in a daemon thread."""

    def __init__(
        self,
        host: str,
        port: int,
        metrics: RelayMetrics,
        gauges: Sequence[DatabaseGauges] | Callable[[], Sequence[DatabaseGauges]],
        ready: Callable[[], Readiness],
    ) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    for each in gauges() if callable(gauges) else gauges:
                        each.refresh()
                    metrics.note_readiness(outer._ready())
                    self._send(200, metrics.render(), "text/plain; version=0.0.4; charset=utf-8")
                elif path == "/livez":
                    self._send(200, "ok\n")
                elif path == "/readyz":
                    readiness = outer._ready()
                    metrics.note_readiness(readiness)
                    self._send(200 if readiness.ok else 503, readiness.text() + "\n")
                else:
                    self._send(404, "not found\n")

            def _send(self, code: int, body: str, ctype: str = "text/plain; charset=utf-8") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return  # scrapes every few seconds are not news

        self._ready = ready
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, name="outbox-http", daemon=True)

    def start(self) -> HealthServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
