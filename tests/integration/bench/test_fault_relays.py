"""The fault harness's relays: one that cannot start says why, at once."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from outbox_bench.faults.config import FaultConfig
from outbox_bench.faults.relays import Relays

from outbox.harness.embedded import free_port


def test_a_relay_that_exits_fails_the_wait_at_once_with_its_exit_and_log(tmp_path: Path) -> None:
    """A harness relay that cannot start (here: nothing listens at its database's port) ends the
    wait when it exits, not after the ready timeout, and the error carries its exit code and the
    end of its log: "did not become ready in 30 s" alone told a CI failure nothing."""
    dsn = f"host=127.0.0.1 port={free_port()} dbname=none user=root connect_timeout=2"
    cfg = FaultConfig(dsn=dsn, bootstrap="127.0.0.1:1", log_dir=tmp_path, ready_timeout=60)
    relays = Relays(cfg, "outbox", "gone", [], {})
    relays.start(0)
    t0 = time.monotonic()
    try:
        with pytest.raises(RuntimeError) as caught:
            relays.wait_ready(0)
    finally:
        relays.stop_all()
    assert time.monotonic() - t0 < 40
    message = str(caught.value)
    assert "relay 0 did not become ready in 60 s (exited with 2)" in message, message
    assert "cannot connect to PostgreSQL" in message, message
