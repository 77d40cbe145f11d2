"""``outbox dev``: a PostgreSQL and a Kafka-protocol broker for trying the quickstart without
Docker. Both are the demo's embedded servers (``outbox.harness.embedded``), in throwaway
storage, on the ports a local install would use, until Ctrl-C. PostgreSQL asks for a password
generated at start; the broker has none to ask for (its help says so)."""

from __future__ import annotations

import signal
import sys
import threading
from urllib.parse import quote

from outbox.errors import ConfigError
from outbox.harness.embedded import Broker, embedded_postgres_server, port_open
from outbox.store import pinning
from outbox.store.queries import query


def run_dev(*, pg_port: int, kafka_port: int, database: str) -> int:
    """Serve until SIGINT or SIGTERM; print the two addresses once both are up."""
    for option, port in (("--pg-port", pg_port), ("--kafka-port", kafka_port)):
        if port_open(port):
            raise ConfigError(
                f"{option}: port {port} is taken on 127.0.0.1 (a server of your own?); pass another"
            )
    stop = threading.Event()
    handlers = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"starting PostgreSQL on localhost:{pg_port} and Kafka on localhost:{kafka_port}", flush=True)
        with embedded_postgres_server() as pg, Broker(kafka_port):
            admin = pg.listen("127.0.0.1", pg_port)
            with pinning.connect(admin, autocommit=True) as conn:
                conn.execute(query("harness_create_database", "public", identifiers={"database": database}))
                version = conn.info.parameter_status("server_version") or "?"
            print(
                f"ready: PostgreSQL {version.split()[0]}, database {database!r} (the password below, "
                "generated now), and a Kafka-protocol broker (Tansu; topics made on first use; no "
                "authentication: any local user may read and write it). Throwaway: Ctrl-C stops "
                "both and deletes their data.\n"
                f"export DATABASE_URL=postgresql://postgres:{quote(pg.password, safe='')}@localhost:"
                f"{pg_port}/{database} KAFKA_BOOTSTRAP=localhost:{kafka_port}",
                flush=True,
            )
            stop.wait()
        print("stopped", file=sys.stderr, flush=True)
        return 0
    finally:
        for sig, previous in handlers.items():
            signal.signal(sig, previous)
