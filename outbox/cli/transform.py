"""``outbox transform test``: try a transform on the latest archived events before deploying it."""

from __future__ import annotations

import argparse
from typing import Any

from outbox.cli.common import add_common, connect_outbox, schema_of, show
from outbox.errors import ConfigError
from outbox.operate import trial
from outbox.store.migrate import require_migrated
from outbox.transform.spec import parse_transform


def register(sub: Any) -> None:
    p = sub.add_parser("transform", help="try a transform (--transform of the relay) on archived events")
    verbs = p.add_subparsers(dest="transform_command", required=True)
    t = verbs.add_parser(
        "test",
        help="run GLOB=module:function on the latest archived events of matching topics and print "
        "each before and after; changes nothing, sends nothing",
    )
    add_common(t)
    t.add_argument("transform", metavar="GLOB=module:function", help="as the relay's --transform takes it")
    t.add_argument("--last", type=int, default=10, help="how many archived events [default: 10]")
    t.set_defaults(run=cmd_test)


def cmd_test(args: argparse.Namespace) -> int:
    if args.last < 1:
        raise ConfigError(f"--last: must be >= 1, got {args.last}")
    transform = parse_transform(args.transform)
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        require_migrated(conn, schema)
        conn.commit()
        events = trial.latest(conn, schema, transform.glob, args.last)
    show(trial.render(trial.run(transform, events)))
    return 0
