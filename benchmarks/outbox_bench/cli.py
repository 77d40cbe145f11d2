"""``outbox bench``, ``outbox bench faults`` and ``outbox bench explore``: registered here (the
``outbox.commands`` entry point ``bench``), run from their packages. Nothing heavy is imported
until a command runs; without psutil and matplotlib the command says so in one line.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox.cli import options
from outbox.cli.common import BENCH_HELP, dsn_of
from outbox.errors import ConfigError
from outbox.settings import setting
from outbox_bench.config import SCENARIOS, BenchConfig
from outbox_bench.explore import cli as explore_cli
from outbox_bench.faults import cli as faults_cli
from outbox_bench.needs import require
from outbox_bench.servers import add_servers


@dataclass
class PerfOptions:
    scenarios: str = setting(
        ",".join(SCENARIOS), f"comma-separated, of: {', '.join(SCENARIOS)}", env="OUTBOX_BENCH_SCENARIOS"
    )
    out: str = setting(
        "bench-results", "output directory (results.json, results.md, PNG plots)", env="OUTBOX_BENCH_OUT"
    )
    smoke: bool = setting(
        False,
        "seconds per scenario instead of minutes: checks that everything runs",
        env="OUTBOX_BENCH_SMOKE",
        aliases=("--short",),
    )


def _add_perf(parser: argparse.ArgumentParser) -> None:
    add_servers(parser)
    options.add(parser, PerfOptions)
    options.add(parser, BenchConfig, env_prefix="OUTBOX_BENCH_", overrides_only=True)
    parser.set_defaults(run=cmd_perf)


def register(sub: Any) -> None:
    # No abbreviations: `bench faults --sink` must not be read as bench's --sinks / --sink-events.
    p = sub.add_parser(
        "bench",
        allow_abbrev=False,
        help=BENCH_HELP,
        description="outbox bench [perf]: speed against the baselines, in the same run. outbox bench faults: "
        "kill, restart, stall and poison things under load, then count what was lost (exit 1 unless every "
        "scenario passes). Without --dsn / --kafka-bootstrap, embedded servers are started.",
    )
    _add_perf(p)  # `outbox bench --scenarios drain` is `outbox bench perf --scenarios drain`
    suites = p.add_subparsers(dest="suite")
    _add_perf(suites.add_parser("perf", help="speed against the baselines (the default)", allow_abbrev=False))
    faults_cli.register(suites)
    explore_cli.register(suites)


# Settings whose help says 0 leaves something out (--big-events 0: no larger backlog).
MAY_BE_ZERO = ("big_events",)


def cmd_perf(args: argparse.Namespace) -> int:
    require("outbox bench")
    from outbox_bench.runner import run_bench

    perf = options.build(PerfOptions, args)
    overrides = options.values(BenchConfig, args)
    for name, value in overrides.items():
        if name in MAY_BE_ZERO and value == 0:
            continue
        if isinstance(value, (int, float)) and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
    chosen = [s.strip() for s in perf.scenarios.split(",") if s.strip()]
    if "sinks" in chosen and "sinks" in overrides:  # a bad --sinks URL: one line before any server starts
        from outbox_bench.harness.taps import tap_class

        for sink in (url for item in overrides["sinks"] for url in item.split()):
            tap_class(sink)
    run_bench(
        dsn=dsn_of(args) or None,
        bootstrap=args.kafka_bootstrap,
        chosen=chosen,
        out=Path(perf.out),
        smoke=perf.smoke,
        overrides=overrides,
    )
    return 0
