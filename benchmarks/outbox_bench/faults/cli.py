"""``outbox bench faults``: registered here, run from ``suite``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.cli import options
from outbox.cli.common import dsn_of
from outbox.errors import ConfigError, OutboxError
from outbox.settings import setting
from outbox_bench.faults.scenarios import SCENARIOS
from outbox_bench.needs import require
from outbox_bench.servers import add_servers

NAMES = tuple(SCENARIOS)


@dataclass
class FaultOptions:
    scenarios: str = setting(
        "",
        f"comma-separated, of: {', '.join(NAMES)}",
        default_text="every one that applies to the sink",
        env="OUTBOX_FAULTS_SCENARIOS",
    )
    sink: str | None = setting(
        None,
        "run against this sink instead of Kafka: amqp://user:pass@host:port/vhost, nats://host:port, "
        "redis://host:port/db, or http (a receiver of the harness's own)",
        env="OUTBOX_FAULTS_SINK",
        metavar="URL",
    )
    out: str = setting(
        "fault-results", "output directory (results.json, results.md, relay logs)", env="OUTBOX_FAULTS_OUT"
    )
    short: bool = setting(
        False,
        "seconds per scenario instead of minutes (still counts every event)",
        env="OUTBOX_FAULTS_SHORT",
        aliases=("--smoke",),
    )
    rate: int | None = setting(
        None, "business transactions per second", default_text="1000; --short 150", env="OUTBOX_FAULTS_RATE"
    )
    capture: str = setting(
        "table",
        "how the load's events are captured: table, or wal (outbox migrate --capture wal: the relays "
        "read a replication slot; needs wal_level=logical, which the embedded PostgreSQL has)",
        choices=("table", "wal"),
        env="OUTBOX_FAULTS_CAPTURE",
    )
    pg_restart_command: str | None = setting(None, "with --dsn: a command that restarts that PostgreSQL")
    broker_stop_command: str | None = setting(None, "with --kafka-bootstrap: a command that stops the broker")
    broker_start_command: str | None = setting(None, "with --kafka-bootstrap: a command that starts it again")


class ScenariosFailed(OutboxError):
    exit_code = 1


def register(suites: Any) -> None:
    p = suites.add_parser("faults", help="break things under load and count what was lost")
    add_servers(p)
    options.add(p, FaultOptions)
    p.set_defaults(run=cmd_faults)


def cmd_faults(args: argparse.Namespace) -> int:
    require("outbox bench faults")
    from outbox_bench.faults.suite import run_faults

    opts = options.build(FaultOptions, args)
    if opts.rate is not None and opts.rate <= 0:
        raise ConfigError(f"--rate: must be > 0, got {opts.rate}")
    results = run_faults(
        dsn=dsn_of(args) or None,
        bootstrap=args.kafka_bootstrap,
        chosen=[s.strip() for s in opts.scenarios.split(",") if s.strip()],
        sink=opts.sink,
        out=Path(opts.out),
        short=opts.short,
        rate=opts.rate,
        capture=opts.capture,
        pg_restart_command=opts.pg_restart_command,
        broker_stop_command=opts.broker_stop_command,
        broker_start_command=opts.broker_start_command,
    )
    failed = [name for name, r in results["scenarios"].items() if not r["passed"]]
    if failed:
        raise ScenariosFailed(
            f"fault scenarios failed: {', '.join(failed)} (details in results.json and the relay logs)"
        )
    return 0
