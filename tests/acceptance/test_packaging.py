"""The wheel ships what the installed package needs: SQL, migrations, and the console's templates
and vendored assets with their licences."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_carries_the_console_assets_and_their_licences(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    # A folder of assets that setuptools could import but was not told about makes every
    # install print a screenful of warnings (scripts/bootstrap shows pip's output).
    assert "is absent from the `packages` configuration" not in out.stderr, out.stderr[:500]
    [wheel] = tmp_path.glob("outbox-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in (
        "outbox/console/templates/base.html",
        "outbox/console/templates/key.html",
        "outbox/console/static/console.css",
        "outbox/console/static/console.js",
        "outbox/console/static/vendor/htmx-2.0.11/htmx.min.js",
        "outbox/console/static/vendor/htmx-2.0.11/LICENSE",
        "outbox/console/static/vendor/uplot-1.6.32/uPlot.iife.min.js",
        "outbox/console/static/vendor/uplot-1.6.32/LICENSE",
        "outbox/sql/console.sql",
        "outbox/migrations/0009_audit.sql",
    ):
        assert shipped in names, shipped
    packages = {
        p.parent.relative_to(ROOT).as_posix().replace("/", ".")
        for p in (ROOT / "outbox").rglob("__init__.py")
    }
    packaged = {n.rsplit("/", 1)[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert packages <= packaged, f"packages missing from the wheel: {packages - packaged}"
