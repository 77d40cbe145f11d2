"""Run the chosen fault scenarios and write their table (see the package docstring)."""

from __future__ import annotations

import datetime
import json
import signal
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from outbox.errors import ConfigError
from outbox.harness.infra import infrastructure
from outbox_bench.faults.config import SHORT, FaultConfig
from outbox_bench.faults.report import markdown
from outbox_bench.faults.scenarios import SCENARIOS, run_scenario
from outbox_bench.harness.taps import tap_class
from outbox_bench.measure import machine

__all__ = ["SCENARIOS", "FaultConfig", "run_faults"]


def run_faults(
    *,
    dsn: str | None,
    bootstrap: str | None,
    chosen: list[str],
    out: Path,
    short: bool,
    rate: int | None = None,
    pg_restart_command: str | None = None,
    broker_stop_command: str | None = None,
    broker_start_command: str | None = None,
    sink: str | None = None,
    capture: str = "table",
) -> dict[str, Any]:
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        raise ConfigError(f"--scenarios: unknown {unknown}; choose from {list(SCENARIOS)}")
    wrong = "kafka" if sink else "other"
    applicable = [name for name, s in SCENARIOS.items() if s.sinks != wrong]
    if not chosen:
        chosen = applicable
    misfits = [s for s in chosen if s not in applicable]
    if misfits:
        against = f"--sink {sink.split('://')[0]}" if sink else "Kafka"
        raise ConfigError(f"--scenarios: {misfits} cannot run against {against}; these can: {applicable}")
    scheme = tap_class(sink).scheme if sink else "kafka"  # a bad --sink or missing extra: one line now

    needs = {need for name in chosen for need in SCENARIOS[name].needs}
    if dsn is not None and "restart_pg" in needs and not pg_restart_command:
        wanting = [s for s in chosen if "restart_pg" in SCENARIOS[s].needs]
        raise ConfigError(f"--pg-restart-command: needed with --dsn for scenarios {wanting}")
    if (
        bootstrap is not None
        and "restart_broker" in needs
        and not (broker_stop_command and broker_start_command)
    ):
        wanting = [s for s in chosen if "restart_broker" in SCENARIOS[s].needs]
        raise ConfigError(
            f"--broker-stop-command and --broker-start-command: needed with --kafka-bootstrap for {wanting}"
        )
    # SIGTERM unwinds like Ctrl-C: relays stopped, embedded servers removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out.mkdir(parents=True, exist_ok=True)
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    with infrastructure(
        dsn,
        bootstrap,
        pg_restart_command=pg_restart_command,
        broker_stop_command=broker_stop_command,
        broker_start_command=broker_start_command,
    ) as infra:
        cfg = FaultConfig(
            dsn=infra.dsn,
            bootstrap=infra.bootstrap,
            restart_pg=infra.restart_pg,
            stop_broker=infra.stop_broker,
            start_broker=infra.start_broker,
            log_dir=logs,
            sink=sink,
            capture=capture,
        )
        if short:
            cfg = replace(cfg, **SHORT)
        if rate is not None:
            cfg = replace(cfg, rate=rate)
        results: dict[str, Any] = {
            "started_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "short": short,
            "sink": scheme,
            "capture": capture,
            "machine": machine(infra.dsn, infra.broker_version),
            "config": {
                k: v
                for k, v in vars(cfg).items()
                if k not in ("dsn", "bootstrap", "log_dir", "sink") and not callable(v)
            },
            "scenarios": {},
        }
        for name in chosen:
            results["scenarios"][name] = run_scenario(cfg, name)
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
            (out / "results.md").write_text(markdown(results))
        print(markdown(results))
    return results
