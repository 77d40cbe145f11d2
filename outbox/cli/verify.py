"""``outbox verify``: read delivered events back from their sinks; ``--repair`` queues what a
broker lost again, under the same event ids."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from typing import Any

from outbox.cli import options
from outbox.cli.common import add_common, connect_outbox, schema_of, show
from outbox.cli.routes import KafkaOptions, RouteOptions, parse_kafka_config
from outbox.escape import escape
from outbox.observe.progress import Progress
from outbox.operate import archive
from outbox.sinks.routes import parse_routes
from outbox.verify import readers, repair, run

MISSING_SHOWN = 50  # ids printed in the text summary (--json prints them all)


def register(sub: Any) -> None:
    p = sub.add_parser(
        "verify",
        help="read delivered events back from their sinks (exit 1 if one lost any; --repair: send again)",
        description="Every archived event of the window is read back at the coordinates its sink gave "
        "(Kafka partition and offset, JetStream stream and sequence, Redis Streams entry id): present, "
        "missing (exit 1), expired (below where the sink's retained log starts), or unverifiable (the "
        "sink keeps no log). Give the relay's routes (--route, --kafka-bootstrap, OUTBOX_ROUTES).",
    )
    add_common(p)
    options.add(p, RouteOptions)
    options.add(p, KafkaOptions)
    p.add_argument("--since", default="24h", help="ISO time (UTC if no zone) or a duration ago [default 24h]")
    p.add_argument("--until", default=None, help="ISO time or a duration ago [default: now]")
    p.add_argument("--topic", metavar="GLOB", help="only events whose topic matches GLOB")
    p.add_argument("--rate", type=float, default=20000.0,
                   help="events read back a second, at most (0: no bound) [default 20000]")  # fmt: skip
    p.add_argument("--ids-only", action="store_true",
                   help="compare event ids only, not payloads and keys (routes whose transforms or "
                   "CloudEvents envelopes change what is sent)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--repair", action="store_true",
                   help="queue the missing events again, each under its own event id")  # fmt: skip
    p.set_defaults(run=cmd_verify)


def cmd_verify(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    now = dt.datetime.now(dt.timezone.utc)
    since = archive.parse_time(args.since, "--since", now)
    until = archive.parse_time(args.until, "--until", now) if args.until else now
    archive.check_window(since, until, now, "--until")
    routes = parse_routes(args.route, args.kafka_bootstrap)
    config = parse_kafka_config(args.kafka_config)

    def reader_for(url: Any) -> Any:
        return readers.reader_for(url, kafka_config=config, compare_bodies=not args.ids_only)

    with connect_outbox(args) as conn:
        total = 0 if args.json else run.count(conn, schema, since, until, args.topic)  # for the bar only
        progress = Progress("verify", total, " ev") if total else None
        report = run.verify(
            conn, schema, routes, reader_for, since=since, until=until, topics=args.topic,
            rate=args.rate, progress=progress.update if progress else None,
        )  # fmt: skip
        if progress is not None:
            progress.close()
        run.record(conn, schema, report, "cli")
        repaired = repair.repair(conn, schema, report, topics=args.topic) if args.repair else None
    if args.json:
        out = report.as_json()
        if repaired is not None:
            out["repaired"] = repaired
        print(json.dumps(out))
    else:
        _summary(report, repaired)
    return 1 if report.missing else 0


def _summary(report: run.Report, repaired: int | None) -> None:
    window = f"{report.since.isoformat(timespec='seconds')} .. {report.until.isoformat(timespec='seconds')}"
    c = report.counts
    show(
        f"verified {report.checked} delivered events of {window}: {c['present']} present, "
        f"{c['missing']} missing, {c['expired']} expired, {c['unverifiable']} unverifiable"
    )
    if report.by_place:
        width = max(len(topic) for topic, _ in report.by_place)
        show(f"  {'topic':<{width}}  {'sink':<28} present missing expired unverifiable")
        for (topic, sink), n in sorted(report.by_place.items()):
            show(
                f"  {topic:<{width}}  {sink:<28} {n['present']:>7} {n['missing']:>7} {n['expired']:>7} "
                f"{n['unverifiable']:>12}"
            )
    for lost in report.missing[:MISSING_SHOWN]:
        show(f"missing {lost.event_id} ({lost.topic} on {lost.sink}): {lost.reason}")
    if len(report.missing) > MISSING_SHOWN:
        show(f"... and {len(report.missing) - MISSING_SHOWN} more (--json lists every id)")
    if repaired is not None:
        show(f"queued {repaired} missing events again, each under its own event id")
    elif report.missing:
        print(escape("outbox verify --repair queues them again"), file=sys.stderr)
