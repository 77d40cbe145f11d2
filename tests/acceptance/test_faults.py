"""The fault suite, short: every scenario under load, against a real PostgreSQL and broker.

Each runs ``outbox bench faults --short --scenarios NAME`` (the real CLI, with its
own embedded PostgreSQL, which it restarts, and its own broker, which it stops),
and fails on any loss, order violation, double archive or unexpected dead letter, or if
the fault did not really happen (each scenario's row in ``SCENARIOS`` says what must).
The full version (minutes per scenario) is ``outbox bench faults``; its table is
in docs/reliability.md.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from outbox.bench.faults.scenarios import SCENARIOS


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
    assert r["provoked"], f"the fault did not happen: {detail}"  # judged by the scenario's own row
    assert f"| {scenario} |" in (tmp_path / "results.md").read_text()
