"""``outbox dev`` lets no other local user in, and leaves nothing running (issue 70, finding 4).

Its PostgreSQL was a superuser with trust auth on 127.0.0.1: another user of the machine connected
with a wrong password and ran ``COPY ... TO PROGRAM``. After Ctrl-C, the postmaster it had
restarted (to listen on TCP) kept running, its data directory deleted and its port held.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time

import psycopg
import pytest

from outbox.harness.embedded import free_port, port_open


def _refused(dsn: str) -> bool:
    try:
        psycopg.connect(dsn, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        return "password authentication failed" in str(exc) or "no password" in str(exc)
    return False


@pytest.mark.slow
def test_outbox_dev_asks_every_client_for_a_generated_password_and_ctrl_c_stops_every_postmaster() -> None:
    pg, kafka = free_port(), free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "outbox", "dev", "--pg-port", str(pg), "--kafka-port", str(kafka)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if line.startswith("export DATABASE_URL=") or not line:
                break
        said = "".join(lines)
        match = re.search(r"DATABASE_URL=(postgresql://postgres:([^@]+)@localhost:\d+/shop)", said)
        assert match, said
        url, password = match[1], match[2]
        assert len(password) >= 24 and "no authentication" in said, said
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT current_user").fetchone() == ("postgres",)
        for wrong in ("postgres", "", password[:-1]):
            assert _refused(url.replace(f":{password}@", f":{wrong}@")), wrong
        assert _refused(f"host=127.0.0.1 port={pg} user=postgres dbname=shop")
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    deadline = time.monotonic() + 10
    while port_open(pg) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not port_open(pg), "a postmaster still holds the port after Ctrl-C"
    assert not port_open(kafka)


def test_its_help_says_what_the_broker_leaves_open() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "outbox", "dev", "--help"], capture_output=True, text=True, check=True
    )
    text = " ".join(out.stdout.split())
    assert "no authentication at all: any user of this machine may read and write its topics" in text, text
    assert "password generated at start" in text
