"""``outbox demo``: the whole pipeline on this machine, with live progress."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from outbox.cli import options
from outbox.cli.common import add_common, dsn_of, schema_of
from outbox.cli.relay import KafkaOptions, parse_kafka_config
from outbox.settings import setting


@dataclass
class DemoOptions:
    seconds: float = setting(0.0, "stop after this many seconds (0: until Ctrl-C)", env="OUTBOX_DEMO_SECONDS")
    rate: float = setting(500.0, "orders per second written by the sample app", env="OUTBOX_DEMO_RATE")
    capture: str = setting(
        "table",
        "how the sample app's events are captured: table (rows) or wal (logical decoding messages "
        "read from a replication slot; needs wal_level=logical, which the embedded PostgreSQL has)",
        choices=("table", "wal"),
        env="OUTBOX_DEMO_CAPTURE",
    )


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on this machine, with live progress")
    add_common(p)
    options.add(p, KafkaOptions)
    options.add(p, DemoOptions)
    p.set_defaults(run=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from outbox.harness.demo import run_demo

    demo = options.build(DemoOptions, args)
    return run_demo(
        dsn=dsn_of(args) or None,
        bootstrap=args.kafka_bootstrap,
        schema=schema_of(args),
        seconds=demo.seconds,
        rate=demo.rate,
        capture=demo.capture,
        kafka_config=parse_kafka_config(args.kafka_config),
    )
