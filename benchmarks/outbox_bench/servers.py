"""The server options every ``outbox bench`` suite takes: the connection, the logs, Kafka.

Without ``--dsn`` / ``--kafka-bootstrap`` the suites start embedded servers
(:mod:`outbox.harness.infra`).
"""

from __future__ import annotations

import argparse

from outbox.cli import options
from outbox.cli.common import add_common
from outbox.cli.routes import KafkaOptions


def add_servers(parser: argparse.ArgumentParser) -> None:
    """Connection and log options; without --dsn / --kafka-bootstrap, embedded servers are started."""
    add_common(parser)
    options.add(parser, KafkaOptions)
