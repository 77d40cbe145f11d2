"""The fault suite, short: every scenario under load, against a real PostgreSQL and broker.

Each runs ``outbox bench faults --short --scenarios NAME`` (the real CLI, with its
own embedded PostgreSQL, which it restarts, and its own broker, which it stops),
and fails on any loss, order violation, double archive or unexpected dead letter.
The full version (minutes per scenario) is ``outbox bench faults``; its table is
in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.bench.faults import SCENARIOS

# What each scenario must have provoked, or it proved nothing.
PROVOKED = {
    "kill": lambda r: r["kills"] >= 3 and r["relay_starts"] >= 5,
    "pg-restart": lambda r: r["reconnects"] + r["writer_errors"] > 0,
    "terminate": lambda r: r["terminated"] >= 3,
    "broker": lambda r: r["producers_recreated"] >= 1,
    "slow-sink": lambda r: r["stale_acks_refused"] >= 1,
    "snapshot": lambda r: r["table_held_peak_mib"] > 0,
    "poison": lambda r: r["poison"] >= 2 and r["dead_lettered"] == r["poison"],
    "sigstop": lambda r: r["ownership_lost"] >= 1,  # the resumed relay found its partitions taken
    "soak": lambda r: r["relay_starts"] >= 4 and "PostgreSQL restarted" in str(r["timeline"]),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_fault_scenario_loses_nothing(scenario: str, tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "outbox",
            "bench",
            "faults",
            "--short",
            "--scenarios",
            scenario,
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    results = json.loads((tmp_path / "results.json").read_text())
    r = results["scenarios"][scenario]
    logs = "\n".join(Path(p).read_text(errors="replace")[-3000:] for p in r["relay_logs"])
    detail = {k: v for k, v in r.items() if k != "relay_logs"}
    assert out.returncode == 0, f"{out.stderr[-3000:]}\n{detail}\n{logs}"
    assert r["passed"] and r["lost"] == 0 and r["order_violations"] == 0 and r["double_archived"] == 0, detail
    assert r["committed"] > 500, detail  # it ran under load
    assert PROVOKED[scenario](r), f"the fault did not happen: {detail}"
    assert f"| {scenario} |" in (tmp_path / "results.md").read_text()
