"""One event's path through the relay, traced on a real relay: from its claim to the batch
leaving the ledger, which relay modules it enters and how often. The stages hand on one way,
so the path is short and enters each module once or twice; the claim path starts no thread and
reads no capture state."""

from __future__ import annotations

import ast
import sys
import threading
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any

import psycopg

import outbox
import outbox.capture
import outbox.relay
from outbox.relay.relay import RelayConfig
from tests.helpers import count, running_relay, wait_for

RELAY = Path(outbox.relay.__file__).parent
CAPTURE = Path(outbox.capture.__file__).parent
# Where an event's path starts on each thread: its claim and hand-on (the loop), its finish
# (a finisher thread), its batch recorded and let go (the loop again).
ROOTS = {("claims.py", "claim"), ("finisher.py", "finish_complete"), ("batch.py", "finish")}


def _properties() -> set[tuple[str, str]]:
    """The relay's properties (file, name): read as fields are (a batch's outcomes awaited), they
    are state, not a step of the path."""
    found = set()
    for path in RELAY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and any(
                isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list
            ):
                found.add((str(path.relative_to(RELAY)), node.name))
    return found


PROPERTIES = _properties()


class _Path:
    """A profile hook on every thread: the relay modules entered (from another module) inside a
    root; and on the claim path, the capture modules reached and the threads started."""

    def __init__(self) -> None:
        self.entries: Counter[str] = Counter()
        self.named: Counter[str] = Counter()
        self.read: set[str] = set()  # properties read
        self.empty_claims = 0
        self.capture: set[str] = set()
        self.started: list[str] = []
        self.on = False
        self._inside = threading.local()
        self._lock = threading.Lock()

    def hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event not in ("call", "return") or not self.on:
            return
        code = frame.f_code
        path = Path(code.co_filename)
        roots: list[str] = self._inside.__dict__.setdefault("roots", [])
        # A root's entries wait here until it returns: a claim that sent nothing (the loop's
        # timer or a wake-up that found the table empty) is not on the event's path.
        seen: list[str] = self._inside.__dict__.setdefault("seen", [])
        root = path.parent == RELAY and (path.name, code.co_name) in ROOTS
        if event == "return":
            if root and roots:
                roots.pop()
                if not roots:
                    self._keep(seen)
            return
        if root:
            roots.append(code.co_name)
        if not roots:
            return
        caller = frame.f_back
        claiming = "claim" in roots  # the claim path: from the claim to the batch handed on
        with self._lock:
            if RELAY in path.parents:
                name = (str(path.relative_to(RELAY)), code.co_name)
                if name in PROPERTIES:
                    self.read.add(f"{name[0]}:{name[1]}")
                elif caller is None or caller.f_code.co_filename != code.co_filename:
                    seen.append(f"{name[0]}:{name[1]}")
            elif path.parent == CAPTURE and claiming:
                self.capture.add(path.name)
            elif path.name == "threading.py" and code.co_name == "start" and claiming:
                self.started.append(threading.current_thread().name)

    def _keep(self, seen: list[str]) -> None:
        with self._lock:
            if seen and seen[0] == "claims.py:claim" and "dispatch.py:send" not in seen:
                self.empty_claims += 1
            else:
                self.named.update(seen)
                self.entries.update(name.split(":")[0] for name in seen)
        seen.clear()


def test_one_events_path_enters_few_relay_modules_each_at_most_twice(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    traced = _Path()
    threading.setprofile(traced.hook)  # the relay's threads, started from here on
    try:
        with running_relay(RelayConfig(pg_dsn, schema=schema), bootstrap=kafka) as relay:
            wait_for(relay.running.is_set, what="the relay started")
            wait_for(lambda: not relay.ledger.busy, what="the relay idle")
            traced.on = True
            with psycopg.connect(pg_dsn) as conn, conn.transaction():
                outbox.enqueue(conn, topic, {"order": 1}, key="k", schema=schema)
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 1, what="the event delivered")
            wait_for(lambda: not relay.ledger.busy, what="its batch left")
            traced.on = False
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
        sys.setprofile(None)
    entries = dict(traced.entries)
    print("relay modules entered on one event's path:", sorted(traced.named.items()))
    print("empty claims left out:", traced.empty_claims, "; properties read:", sorted(traced.read))
    stages = {"claims.py", "intake.py", "claim.py", "dispatch.py", "ledger.py", "finisher.py"}
    assert stages <= set(entries) and PROPERTIES, entries
    # The stages, the scheduler and the recorder they ask, the event's batch and its outbox's key
    # holds: 10 modules (docs/decisions/0011). The root is not called back (the sink of the
    # moment, whether metrics are kept) and the lane is read, not asked. No module is entered
    # more than twice: the finisher hands the batch over and records it, each once (it is
    # walked only when it has work: BatchFinisher.to_finish); the scheduler is told what the
    # claim took and paces the outbox as the batch leaves (the claim's limit and companions
    # came with its choice: Pick); the recorder counts the claim and records the result.
    assert len(entries) <= 10 and "wal_intake.py" not in entries, entries
    assert "relay.py" not in entries and "lanes.py" not in entries, entries
    assert max(entries.values()) <= 2, entries
    assert traced.started == [] and traced.capture == set()
