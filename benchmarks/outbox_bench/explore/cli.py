"""``outbox bench explore``: registered here, run from :mod:`.search`."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.cli import options
from outbox.errors import ConfigError
from outbox.extras import require
from outbox.settings import setting

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smh]?)$")


@dataclass
class ExploreOptions:
    seed: int = setting(1, "the schedule's seed (with --schedules: the first)", env="OUTBOX_EXPLORE_SEED")
    schedules: int = setting(
        1, "schedules to run, from --seed on, until one fails", env="OUTBOX_EXPLORE_SCHEDULES"
    )
    budget: str = setting(
        "", "stop starting schedules after this long: 90s, 10m, 2h", default_text="no limit",
        env="OUTBOX_EXPLORE_BUDGET",
    )  # fmt: skip
    dry_run: bool = setting(False, "only print the schedule of --seed")
    schedule: str | None = setting(None, "replay this schedule file (a shrunk failure's)", metavar="FILE")
    shrink: bool = setting(True, "shrink a failing schedule (fewer faults, fewer events)")
    relay_sink: str = setting(
        "outbox_bench.explore.sink:scripted",
        "the relays' --sink: the scripted sink, or a wrapper of it (one that puts a known bug back, "
        "to see the explorer find it)",
        metavar="MODULE:FACTORY",
    )
    out: str = setting(
        "explore-results", "output directory (schedules, relay logs, journals)", env="OUTBOX_EXPLORE_OUT"
    )


def duration(text: str, field: str) -> float:
    """Seconds of ``90s``, ``10m``, ``2h`` or ``45``."""
    m = _DURATION.match(text.strip())
    if not m:
        raise ConfigError(f"{field}: expected a duration such as 90s, 10m or 2h, got {text!r}")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


def register(suites: Any) -> None:
    p = suites.add_parser(
        "explore",
        allow_abbrev=False,
        help="play seeded schedules of faults against real relays and check the invariants",
        description="outbox bench explore: a seed draws a schedule (relays, keys, batch sizes, leases, a "
        "scripted sink's latencies, freezes, failures and refusals, SIGKILL, SIGSTOP, terminated sessions, a "
        "PostgreSQL restart, redrives and skips); it is played against real relay processes on a PostgreSQL "
        "of its own, then checked. Exit 0 when every invariant held, 1 with the first violation.",
    )
    options.add(p, ExploreOptions)
    p.set_defaults(run=cmd_explore)


def _say(line: str) -> None:
    print(line, flush=True)


def cmd_explore(args: argparse.Namespace) -> int:
    from outbox_bench.explore.schedule import Schedule, draw

    opts = options.build(ExploreOptions, args)
    if opts.schedules < 1:
        raise ConfigError(f"--schedules: must be >= 1, got {opts.schedules}")
    budget = duration(opts.budget, "--budget") if opts.budget else float("inf")
    chosen: Schedule | None = None
    if opts.schedule is not None:
        try:
            chosen = Schedule.from_json(Path(opts.schedule).read_text())
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ConfigError(f"--schedule: cannot read {opts.schedule!r}: {exc}") from None
    if opts.dry_run:
        print((chosen or draw(opts.seed)).render())
        return 0
    require("embedded", "outbox bench explore")
    from outbox.harness.embedded import embedded_postgres_server
    from outbox_bench.explore.search import Found, play, report, search, shrink
    from outbox_bench.explore.world import World

    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    with embedded_postgres_server() as server:
        world = World(server, out, sink=opts.relay_sink)
        if chosen is not None or opts.schedules == 1:
            schedule = chosen or draw(opts.seed)
            _say(schedule.render())
            record, violations = play(world, schedule, _say)
            found = Found(schedule, violations, record) if violations else None
            if found is None:
                _say(f"every invariant held ({len(record.committed)} events committed)")
        else:
            found = search(world, opts.seed, opts.schedules, budget, _say)
        if found is not None and opts.shrink and chosen is None:
            found = shrink(world, found, min(600.0, budget / 2), _say)
    if found is None:
        return 0
    print(report(found, out, opts.relay_sink), flush=True)
    return 1
