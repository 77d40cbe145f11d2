"""Run the chosen benchmark scenarios on the servers given (or embedded ones) and write the report."""

from __future__ import annotations

import datetime
import shlex
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from outbox.errors import ConfigError
from outbox.harness.infra import infrastructure
from outbox_bench import report, scenarios
from outbox_bench.config import SCENARIOS, SMOKE, BenchConfig
from outbox_bench.measure import machine

ALL = list(SCENARIOS)


def run_bench(
    *,
    dsn: str | None,
    bootstrap: str | None,
    chosen: list[str],
    out: Path,
    smoke: bool,
    overrides: dict[str, Any],
) -> dict[str, Any]:
    unknown = [s for s in chosen if s not in ALL]
    if unknown:
        raise ConfigError(f"--scenarios: unknown {unknown}; choose from {ALL}")
    with infrastructure(dsn, bootstrap) as infra:
        dsn, bootstrap, broker_version = infra.dsn, infra.bootstrap, infra.broker_version
        cfg = BenchConfig(dsn=dsn, bootstrap=bootstrap)
        if smoke:
            cfg = replace(cfg, **SMOKE)  # type: ignore[arg-type]
        cfg = replace(cfg, **overrides)
        results: dict[str, Any] = {
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": "outbox bench " + shlex.join(sys.argv[2:]) if len(sys.argv) > 1 else "",
            "smoke": smoke,
            "machine": machine(dsn, broker_version),
            "config": {k: v for k, v in vars(cfg).items() if k not in ("dsn", "bootstrap")},
            "scenarios": {},
        }
        for name in chosen:
            print(f"== {name}", file=sys.stderr)
            results["scenarios"][name] = getattr(scenarios, name)(cfg)
            report.write(results, out)  # keep what is done if a later scenario fails
    print(report.markdown(results))
    print(f"\nresults written to {out}/ (results.json, results.md, PNG plots)", file=sys.stderr)
    return results
