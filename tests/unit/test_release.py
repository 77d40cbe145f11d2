"""The release's files and names: the distribution is ``outbox-relay`` (``pip install outbox`` is
somebody else's package), its version has one source, and the root files a user looks for exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

import outbox
from outbox.errors import MissingExtra
from outbox.extras import EXTRAS

pytestmark = pytest.mark.same_on_every_python

ROOT = Path(__file__).resolve().parents[2]

# An install line or a metadata lookup naming the import package instead of the distribution:
# `pip install outbox`, `pip install 'outbox[console]'`, `outbox[aws]`, version("outbox").
WRONG_NAME = re.compile(
    r"pip3? install (?:-U |--upgrade )?['\"]?outbox(?![\w-])"
    r"|(?<![\w.\-/])outbox\[[a-z0-9,\- ]+\]"
    r"|version\(['\"]outbox['\"]\)"
)


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split("\0")
    files = []
    for name in names:
        path = ROOT / name
        if not name or not path.is_file() or path.suffix in {".png", ".whl", ".gz", ".ico", ".woff2"}:
            continue
        files.append(path)
    return files


def test_no_install_line_or_message_names_the_import_package_instead_of_the_distribution() -> None:
    found = []
    for path in _tracked_text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if path.name == "test_release.py":
                continue
            if WRONG_NAME.search(line):
                found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_scan_catches_each_wrong_form() -> None:
    for wrong in (
        "pip install outbox",
        "pip install 'outbox[console]'",
        "`outbox[aws]`",
        'version("outbox")',
    ):
        assert WRONG_NAME.search(wrong), wrong
    for right in (
        "pip install outbox-relay",
        "pip install 'outbox-relay[console]'",
        "lanes[outbox]",
        "self.outbox[0]",
    ):
        assert not WRONG_NAME.search(right), right


def test_a_missing_extra_names_the_distribution() -> None:
    assert (
        str(MissingExtra("the console", "console"))
        == "the console needs: pip install 'outbox-relay[console]'"
    )


def test_the_distribution_its_version_and_its_extras() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (the main suite's 3.11 runs it)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "outbox-relay"
    # One source: pyproject reads outbox/_version.py, which the package exports.
    assert "version" not in project and project["dynamic"] == ["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", outbox.__version__)
    assert f"## [{outbox.__version__}]" in (ROOT / "CHANGELOG.md").read_text()
    # Every extra the code may ask for exists in the distribution.
    assert set(EXTRAS) <= set(project["optional-dependencies"])
    assert project["license-files"] == ["LICENSE"]


def test_the_bench_is_released_with_the_runtime_at_its_version() -> None:
    """outbox-relay-bench (benchmarks/) has outbox-relay's version and requires exactly it: a
    bench measures the relay it was released with."""
    tomllib = pytest.importorskip("tomllib")
    import outbox_bench._version
    from outbox_bench.needs import NEEDS

    project = tomllib.loads((ROOT / "benchmarks" / "pyproject.toml").read_text())["project"]
    assert project["name"] == "outbox-relay-bench" and project["dynamic"] == ["version"]
    assert outbox_bench._version.__version__ == outbox.__version__
    assert f"outbox-relay[embedded]=={outbox.__version__}" in project["dependencies"]
    assert set(NEEDS) - {""} <= set(project["optional-dependencies"])
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not {"bench", "bench-peers"} & set(runtime["optional-dependencies"])


def test_the_root_files_a_user_looks_for_exist() -> None:
    for name in ("README.md", "LICENSE", "CHANGELOG.md", "SECURITY.md", "CONTRIBUTING.md"):
        assert (ROOT / name).is_file(), name
    assert "Apache License" in (ROOT / "LICENSE").read_text()
    # A page, not a manual: the quickstart's five steps and two programs are most of it.
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250
