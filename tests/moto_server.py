"""``python -m tests.moto_server HOST PORT``: moto's server, answering one request at a time.

moto's own ``moto.server`` answers each request in a thread, and some of its models are not
safe for that: its Kinesis shard gives a record the sequence number after the last one without
a lock ("this function is not safe for concurrency"), so two concurrent PutRecords can store
two records under one number and lose one. AWS does not. One request at a time is what the
tests need from it (tests/aws_servers.py).
"""

from __future__ import annotations

import sys

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
from moto.server import MotoRequestHandler
from werkzeug.serving import run_simple

if __name__ == "__main__":
    run_simple(
        sys.argv[1],
        int(sys.argv[2]),
        DomainDispatcherApplication(create_backend_app),
        threaded=False,
        request_handler=MotoRequestHandler,
    )
