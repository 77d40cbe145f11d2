"""``python -m tests.flaky_relay relay …``: the real CLI, every sink wrapped in AnyFlakySink.

The failure rate comes from OUTBOX_TEST_FAILURE_RATE (default 0.05). Used by the tests
of per-key order through failures on the sinks that have no --sink hook.
"""

from __future__ import annotations

import os
import sys

from outbox.sinks import make
from outbox.sinks.base import Sink
from outbox.sinks.routes import SinkURL
from tests.sinks import AnyFlakySink

_make = make.SinkMaker.__call__


def _flaky(self: make.SinkMaker, url: SinkURL) -> Sink:
    return AnyFlakySink(_make(self, url), float(os.environ.get("OUTBOX_TEST_FAILURE_RATE", "0.05")))


make.SinkMaker.__call__ = _flaky  # type: ignore[method-assign]

if __name__ == "__main__":
    from outbox.cli import main

    sys.exit(main(sys.argv[1:]))
