"""The previous release, built from its tag: its wheel, unpacked where this suite's Python can
run it beside this version.

``build()`` makes the wheel of ``v0.2.0`` (``git archive`` of the tag, ``pip wheel``) once per
commit of the tag, under a lock (the suite's workers share it), and unpacks it. ``run`` gives
``python -m outbox`` of that release: its package first on the path, from a directory of its
own (so that this checkout's ``outbox`` is not found first), with this environment's
dependencies (within what the release declared). CHANGELOG.md names the tag and its commit.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TAG = "v0.2.0"
COMMIT = "3224830"  # what CHANGELOG.md names for 0.2.0, when the clone has no tags


@dataclass(frozen=True)
class Release:
    version: str
    site: Path  # the wheel unpacked: put first on PYTHONPATH
    home: Path  # a directory of its own to run in

    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
        base["PYTHONPATH"] = os.pathsep.join([str(self.site), str(ROOT)])  # tests.* after its outbox
        return base

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "outbox", *args]

    def check(self) -> str:
        """The version its package says it is (proof that it, not this checkout, is run)."""
        out = subprocess.run(
            [sys.executable, "-c", "import outbox; print(outbox.__version__, outbox.__file__)"],
            cwd=self.home,
            env=self.env(),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert out[1].startswith(str(self.site)), out
        return out[0]


def _ref() -> str:
    for ref in (TAG, COMMIT):
        found = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        if found.returncode == 0:
            return found.stdout.strip()
    raise AssertionError(f"neither the tag {TAG} nor the commit {COMMIT} is in this clone")


def build() -> Release:
    commit = _ref()
    cache = Path(tempfile.gettempdir()) / f"outbox-release-{commit[:12]}"
    cache.mkdir(exist_ok=True)
    with open(cache / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        site, home = cache / "site", cache / "home"
        if not (site / "outbox" / "__init__.py").exists():
            source = cache / "source"
            source.mkdir(exist_ok=True)
            archive = subprocess.run(
                ["git", "archive", commit], cwd=ROOT, capture_output=True, check=True
            ).stdout
            subprocess.run(["tar", "-x", "-C", str(source)], input=archive, check=True)
            wheels = cache / "wheels"
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "wheel",
                    "--no-deps",
                    "-q",
                    "-w",
                    str(wheels),
                    str(source),
                ],
                check=True,
                capture_output=True,
            )
            (wheel,) = wheels.glob("outbox_relay-*.whl")
            with zipfile.ZipFile(wheel) as z:
                z.extractall(site)
            home.mkdir(exist_ok=True)
        version = next(site.glob("outbox_relay-*.dist-info")).name.removesuffix(".dist-info").split("-")[1]
        return Release(version, site, home)
