"""``python -m tests.moto_server HOST PORT``: moto's server, running one request at a time.

moto's own ``moto.server`` answers each request in a thread, and some of its models are not
safe for that: its Kinesis shard gives a record the sequence number after the last one without
a lock ("this function is not safe for concurrency"), so two concurrent PutRecords can store
two records under one number and lose one. AWS does not. One request at a time is what the
tests need from it (tests/aws_servers.py).

The requests are taken in threads, and run one at a time under a lock. A server of one thread
(how this began) reads each connection's request itself: while it waits on one client (a relay
whose connection the fault harness's proxy has not passed on yet), it accepts no other. In CI,
on a starved machine, the relays' connects through the proxy then timed out for over a minute
after a 4 s sink outage had healed (the kinesis fault row: 156 events not delivered by the
drain's deadline, none lost or out of order); a server that stalls on one client is the likely
cause. Threads also keep connections alive (HTTP/1.1), so a relay does not connect anew for
each call.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.server import MotoRequestHandler
from werkzeug.serving import run_simple


class OneAtATime:
    """A WSGI app that runs ``app`` for one request at a time, its whole answer included."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self._app = app
        self._lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with self._lock:
            return list(self._app(environ, start_response))


if __name__ == "__main__":
    run_simple(
        sys.argv[1],
        int(sys.argv[2]),
        OneAtATime(DomainDispatcherApplication(create_backend_app)),
        threaded=True,
        request_handler=MotoRequestHandler,
    )
