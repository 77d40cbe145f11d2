"""``outbox capture``: WAL capture's signing keys (``rotate-key``)."""

from __future__ import annotations

import argparse
from typing import Any

from outbox import capture
from outbox.cli.common import add_common, add_confirm, confirm, connect_outbox, schema_of, show
from outbox.operate import archive
from outbox.store.migrate import require_migrated


def register(sub: Any) -> None:
    p = sub.add_parser("capture", help="WAL capture's signing keys")
    verbs = p.add_subparsers(dest="capture_command", required=True)
    r = verbs.add_parser(
        "rotate-key",
        help="a new key signs WAL capture's messages from now on; the old one verifies what commits "
        "within --window, then nothing (a leaked key signs nothing delivered after that)",
    )
    add_common(r)
    r.add_argument(
        "--window",
        default="1h",
        help="how long the old key still verifies what commits, e.g. 15m, 1h (writers that read it "
        "just before the rotation commit within it; at least 60s) [default: 1h]",
    )
    add_confirm(r, "the rotation")
    r.set_defaults(run=cmd_rotate_key)


def cmd_rotate_key(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    window = archive.parse_duration(args.window, "--window").total_seconds()
    capture.check_window(window)
    with connect_outbox(args) as conn:
        require_migrated(conn, schema)
        conn.commit()
        if args.dry_run:
            show(f"would rotate the WAL signing key of schema {schema}; the old would verify {args.window}")
            return 0
        confirm(args, f"rotate the WAL signing key of schema {schema}")
        done = capture.rotate_key(conn, schema, window)
    retired = ", ".join(f"key {i} until {at.isoformat(timespec='seconds')}" for i, at in done.retired)
    show(f"schema {schema}: key {done.new} signs from now on; still verifying: {retired}")
    if done.dropped:
        show(f"dropped keys the slot has read past every message of: {', '.join(map(str, done.dropped))}")
    return 0
