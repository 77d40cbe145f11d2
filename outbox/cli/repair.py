"""Commands that change events after the fact: dead letters (list, redrive, skip, and retry),
replay and purge of the archive, and the audit trail that records each of them."""

from __future__ import annotations

import argparse
import datetime as dt
import json
from dataclasses import replace
from typing import Any

from outbox.cli import options
from outbox.cli.common import add_common, add_confirm, confirm, connect_outbox, key_arg, schema_of, show
from outbox.cli.operate import StoreOption, store_of
from outbox.errors import ConfigError, NothingMatched
from outbox.observe.progress import Progress
from outbox.operate import archive, audit, dead


def register(sub: Any) -> None:
    p = sub.add_parser("dead", help="list, redrive or skip dead letters (parked keys)")
    verbs = p.add_subparsers(dest="dead_command", required=True)
    d = verbs.add_parser("list", help="dead letters with the events parked behind them")
    _add_selector(d)
    d.add_argument("--limit", type=int, default=100, help="at most this many [default 100]")
    d.add_argument("--json", action="store_true", help="print one JSON array")
    d.set_defaults(run=cmd_dead_list, everything_unless_filtered=True)
    d = verbs.add_parser(
        "redrive", help="put dead letters back at the head of their key; parked events follow in order"
    )
    _add_selector(d, confirm_what="the redrive")
    _add_unverified(d)
    d.set_defaults(run=cmd_redrive, verb="redrive", everything_unless_filtered=False)
    d = verbs.add_parser("skip", help="give dead letters up and release the events parked behind them")
    _add_selector(d, confirm_what="the skip")
    d.set_defaults(run=cmd_skip, everything_unless_filtered=False)

    p = sub.add_parser(
        "retry", help="put dead letters back into the outbox: `dead redrive`, every one unless filtered"
    )
    _add_selector(p, confirm_what="the retry")
    _add_unverified(p)
    p.set_defaults(run=cmd_redrive, verb="retry", everything_unless_filtered=True)

    p = sub.add_parser("replay", help="re-send archived events delivered in a time window")
    add_common(p)
    p.add_argument("--since", required=True, help="ISO time (UTC if no zone) or a duration ago, e.g. 2h")
    p.add_argument("--until", default=None, help="ISO time or a duration ago [default: now]")
    p.add_argument("--topic", help="only events of this topic")
    p.add_argument("--key", help="only events of this key (UTF-8 text, or 0x... for bytes)")
    p.add_argument(
        "--upto",
        type=int,
        metavar="ID",
        help="only archived events up to this id (what a console preview counted)",
    )
    add_confirm(p, "the replay")
    p.set_defaults(run=cmd_replay)

    p = sub.add_parser(
        "purge",
        help="drop archive partitions older than a duration, and the claim-check payloads of those days",
    )
    add_common(p)
    options.add(p, StoreOption)
    p.add_argument("--older-than", required=True, help="a duration, e.g. 30d, 12h")
    add_confirm(p, "the purge")
    p.set_defaults(run=cmd_purge)

    p = sub.add_parser("audit", help="who redrove, skipped, replayed or purged what, and when")
    add_common(p)
    p.add_argument("--limit", type=int, default=50, help="the latest this many [default 50]")
    p.add_argument("--json", action="store_true", help="print one JSON array")
    p.set_defaults(run=cmd_audit)


def _add_selector(parser: argparse.ArgumentParser, confirm_what: str | None = None) -> None:
    """The one way to choose dead letters, shared by dead list/redrive/skip and retry."""
    add_common(parser)
    parser.add_argument("ids", nargs="*", type=int, metavar="ID", help="these dead letters")
    parser.add_argument(
        "--ids", dest="more_ids", nargs="+", type=int, metavar="ID", help="these dead letters"
    )
    parser.add_argument("--key", help="of this key (UTF-8 text, or 0x... for bytes)")
    parser.add_argument("--topic", help="of this topic")
    parser.add_argument(
        "--error-like", help="whose error matches this SQL LIKE pattern, e.g. '%%timed out%%'"
    )
    parser.add_argument("--error", help="whose error contains this text, in any case (the console's filter)")
    parser.add_argument("--fingerprint", help="whose error's fingerprint is this (a console group)")
    parser.add_argument(
        "--since", help="that failed at or after this ISO time (UTC if no zone) or duration ago"
    )
    parser.add_argument("--until", help="that failed before this ISO time or duration ago")
    parser.add_argument(
        "--high-water", type=int, metavar="SEQ", help="made up to this mark (a console page's), none after it"
    )
    parser.add_argument("--all", action="store_true", help="every dead letter")
    if confirm_what is not None:
        add_confirm(parser, confirm_what)


def _add_unverified(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--include-expired",
        action="store_true",
        help="also the dead letters that expired (kind expired: claimed at or after their "
        "expires_at); they go back without their expiry, to be delivered late. Without it they stay",
    )
    parser.add_argument(
        "--include-unverified",
        action="store_true",
        help="also the dead letters given by ID that the relay could not verify as events of this "
        "outbox: unsigned_event (a WAL message no writer of it signed: any role may emit one) and "
        "corrupt_event (no event's encoding). Without it they stay; no filter but IDs takes them",
    )


def _selector(args: argparse.Namespace) -> dead.Selector:
    ids = tuple(args.ids or ()) + tuple(args.more_ids or ())
    unverified = getattr(args, "include_unverified", False)
    if unverified and (not ids or args.all or args.key or args.topic or args.error_like or args.error):
        raise ConfigError(
            "--include-unverified: only with dead letter IDs and no other filter: a message the relay "
            "could not verify is redriven one by one, knowingly"
        )
    key = key_arg(args.key)
    now = dt.datetime.now(dt.timezone.utc)
    try:
        return dead.Selector(
            ids=ids,
            key=key,
            topic=args.topic,
            error_like=args.error_like,
            everything=args.all or args.everything_unless_filtered,
            error=args.error,
            fingerprint=args.fingerprint,
            since=archive.parse_time(args.since, "--since", now) if args.since else None,
            until=archive.parse_time(args.until, "--until", now) if args.until else None,
            high_water=args.high_water,
            unverified=unverified,
            expired=getattr(args, "include_expired", False),
        )
    except ConfigError as exc:
        if str(exc).startswith("--"):
            raise
        raise ConfigError(
            f"dead {args.dead_command}: give dead letter IDs, --key, --topic, --error-like, --error, "
            "--fingerprint, --since, --until or --all"
        ) from None


def _choosing(args: argparse.Namespace) -> dead.Selector:
    """What a command chooses among: listing and skipping the dead letters the relay could not
    verify is harmless, a redrive takes them only when asked (by id, --include-unverified)."""
    chosen = _selector(args)
    return chosen.also_unverified() if getattr(args, "dead_command", None) in ("list", "skip") else chosen


def cmd_dead_list(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        ids = dead.select(conn, schema, _choosing(args))[: args.limit]
        rows = dead.details(conn, schema, ids) if ids else []
    show(json.dumps(rows) if args.json else dead.render(rows))
    return 0


def _chosen(args: argparse.Namespace, verb: str, conn: Any, schema: str) -> list[int] | None:
    """The chosen ids after the dry run / confirmation; None when it was a dry run."""
    chosen = _choosing(args)
    ids = dead.select(conn, schema, chosen)
    if not ids:
        left = 0 if chosen.expired else dead.count(conn, schema, replace(chosen, expired=True))
        raise NothingMatched(
            "no dead letter matches"
            + (f" but {left} that expired (--include-expired to redrive them, late)" if left else "")
        )
    shown = f"{ids[:20]}" + (" ..." if len(ids) > 20 else "")
    if args.dry_run:
        show(f"would {verb} {len(ids)} dead letters: {shown}")
        conn.rollback()
        return None
    confirm(args, f"{verb} {len(ids)} dead letters {shown}")
    return ids


def _dead_action(args: argparse.Namespace, action: str) -> int | None:
    """Choose, confirm, act and record it in the audit trail, in one transaction; how many."""
    schema = schema_of(args)
    with connect_outbox(args) as conn:
        ids = _chosen(args, args.verb if action == "redrive" else action, conn, schema)
        if ids is None:
            return None
        n = dead.act(conn, schema, action, ids, _selector(args).audited())
        conn.commit()
    return n


def cmd_redrive(args: argparse.Namespace) -> int:
    n = _dead_action(args, "redrive")
    if n is None:
        return 0
    show(
        f"redrove {n} dead letters (attempts reset); they are delivered first, "
        "then the events parked behind them"
    )
    return 0


def cmd_skip(args: argparse.Namespace) -> int:
    n = _dead_action(args, "skip")
    if n is None:
        return 0
    show(f"skipped {n} dead letters; the events parked behind them are released")
    return 0


# -- the archive ---------------------------------------------------------------------------------


def cmd_replay(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    now = dt.datetime.now(dt.timezone.utc)
    since = archive.parse_time(args.since, "--since", now)
    until = archive.parse_time(args.until, "--until", now) if args.until else now
    archive.check_window(since, until, now, "--until")
    key = key_arg(args.key)
    with connect_outbox(args) as conn:
        n, upto = archive.replay_count(
            conn, schema, since=since, until=until, topic=args.topic, key=key, upto=args.upto
        )
        window = f"{since.isoformat(timespec='seconds')} .. {until.isoformat(timespec='seconds')}"
        if args.dry_run or not n:
            show(f"would replay {n} archived events delivered {window}")
            return 0
        confirm(args, f"replay {n} archived events delivered {window}")
        progress = Progress("replay", n, " ev")
        done = archive.replay_recorded(
            conn, schema, since=since, until=until, topic=args.topic, key=args.key, planned=n,
            upto=upto, progress=progress.update,
        )  # fmt: skip
        progress.close()
    show(f"queued {done} events again, with new event-ids and header outbox-replay-of")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    schema = schema_of(args)
    cutoff = dt.datetime.now(dt.timezone.utc) - archive.parse_duration(args.older_than, "--older-than")
    with connect_outbox(args) as conn:
        parts = archive.purge_plan(conn, schema, cutoff)
        what = f"{len(parts)} archive partitions before {cutoff.date().isoformat()}"
        if args.dry_run:
            show(
                f"would drop {what}: {', '.join(parts) or '-'} (and older rows of delivered_default, "
                "and claim-check payloads stored before the cutoff)"
            )
            return 0
        confirm(args, f"drop {what}")
        chosen = {"older_than": args.older_than, "cutoff": cutoff.isoformat(), "partitions": parts}
        entry = audit.begin(conn, schema, action="purge", selector=chosen, planned=len(parts))
        conn.commit()
        progress = Progress("purge", max(len(parts), 1), " partitions")
        deleted = archive.purge(conn, schema, cutoff, parts, progress=progress.update)
        progress.close()
        audit.done(conn, schema, entry, len(parts))
        conn.commit()
    store = store_of(args, schema)
    try:
        payloads = store.purge(cutoff)
    finally:
        store.close()
    show(
        f"dropped {len(parts)} partitions; deleted {deleted} older rows from delivered_default "
        f"and {payloads} claim-check payloads ({store.name})"
    )
    return 0


# -- the audit trail -----------------------------------------------------------------------------


def cmd_audit(args: argparse.Namespace) -> int:
    if args.limit < 1:
        raise ConfigError(f"--limit: must be >= 1, got {args.limit}")
    with connect_outbox(args) as conn:
        rows = audit.recent(conn, schema_of(args), args.limit)
    show(json.dumps(rows) if args.json else audit.render(rows))
    return 0
