"""A real PgBouncer (Debian's package) in front of the tests' PostgreSQL, on a free port.

One process serves the test database three times: ``outbox_transaction`` in ``pool_mode =
transaction``, ``outbox_session`` in ``pool_mode = session`` and ``outbox_statement`` in
``pool_mode = statement``. The transaction pool is smaller than the tests'
concurrency, so clients really share server connections between transactions (with a pool
as large as the clients, each would keep one by luck and hide what breaks).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox.harness.embedded import free_port

POOL_SIZE = 3  # server connections per transaction pool: fewer than the tests' 8 clients
SESSION_POOL_SIZE = 20  # a session each: the relay's (listener, batches, hygiene, metrics), writers


class PgBouncer:
    def __init__(self, dsn: str) -> None:
        binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
        if not Path(binary).exists():
            raise RuntimeError("pgbouncer is not installed: ./scripts/bootstrap installs Debian's pgbouncer")
        self.binary = binary
        self.target = conninfo_to_dict(dsn)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
        self.proc: subprocess.Popen[bytes] | None = None

    def dsn(self, mode: str) -> str:
        """The DSN of the pool in ``mode`` (transaction, session or statement)."""
        return make_conninfo(
            "",
            host="127.0.0.1",
            port=self.port,
            dbname=f"outbox_{mode}",
            user=self.target.get("user", "root"),
        )

    def start(self) -> PgBouncer:
        t = self.target
        server = " ".join(
            f"{k}={v}" for k, v in (("host", t.get("host", "127.0.0.1")), ("port", t.get("port", 5432)),
                                    ("dbname", t.get("dbname", "")), ("user", t.get("user", "root"))) if v
        )  # fmt: skip
        user = t.get("user", "root")
        (self.dir / "users.txt").write_text(f'"{user}" ""\n')
        (self.dir / "pgbouncer.ini").write_text(
            "[databases]\n"
            f"outbox_transaction = {server} pool_mode=transaction\n"
            f"outbox_session = {server} pool_mode=session pool_size={SESSION_POOL_SIZE}\n"
            f"outbox_statement = {server} pool_mode=statement\n"
            "[pgbouncer]\n"
            f"listen_addr = 127.0.0.1\nlisten_port = {self.port}\nunix_socket_dir =\n"
            f"auth_type = trust\nauth_file = {self.dir / 'users.txt'}\n"
            f"default_pool_size = {POOL_SIZE}\nmax_client_conn = 500\n"
            f"logfile = {self.dir / 'pgbouncer.log'}\n"
        )
        os.chmod(self.dir, 0o777)
        for f in self.dir.iterdir():
            os.chmod(f, 0o666)
        # PgBouncer will not run as root: it switches to the PostgreSQL server's user.
        cmd = [
            self.binary,
            *(["-u", "postgres"] if os.getuid() == 0 else []),
            str(self.dir / "pgbouncer.ini"),
        ]
        with (self.dir / "stderr").open("wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        deadline = time.monotonic() + 15
        while True:
            try:
                psycopg.connect(self.dsn("session"), connect_timeout=2).close()
                return self
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (
                        (self.dir / "pgbouncer.log").read_text()
                        if (self.dir / "pgbouncer.log").exists()
                        else ""
                    )
                    err = (
                        self.proc.stderr.read().decode()
                        if self.proc.stderr and self.proc.poll() is not None
                        else ""
                    )
                    self.stop()
                    raise RuntimeError(f"pgbouncer did not start: {err}{log[-2000:]}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)
