"""The invariants, checked from a run's record: it shares no code with the relay.

What it reads: the writer's account (committed, rolled back, or interrupted at commit), the
scripted receiver's journal (each event it got, when, and whether the relay had given up on it),
the operator's actions, the faults played, the tables at the end (archive, dead letters,
pending), and the relays' JSON logs. Events are the writer's numbers (``n``), in commit order.

1. Every committed event is archived (and was received), dead-lettered, or pending behind a
   parked dead letter of its key (``on-dead=park``).
2. Nothing rolled back is received, archived or dead-lettered.
3. Per key (``ordering=key``), first receipts follow commit order: an event is received only
   after each earlier event of its key was received, or was dead-lettered and so stopped
   blocking it (``continue``: when it failed for the last time; ``park``: when the operator
   skipped it).
4. Nothing is archived twice.
5. An event received more than once has a reason for every receipt but one: it was sent in a
   window where its batch's outcome could be lost (a relay killed, stopped, cut off from the
   database, the database restarted: from a lease before to a lease after; a batch's lease
   lost: its relay's log line), or the relay had given up on it already (a late ack).
6. Logs stay within the outage rules: no warning or error line, the same but for its numbers,
   more than LOG_REPEATS times in LOG_WINDOW seconds in one relay (a dead letter's own line
   apart: one per event, by design).
"""

from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from outbox_bench.explore.world import Record

LOG_WINDOW = 10.0  # seconds
LOG_REPEATS = 10
FAILED = ("failed", "refused", "timeout")


@dataclass(frozen=True)
class Violation:
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"{self.invariant}: {self.detail}"


def check(rec: Record) -> list[Violation]:
    out: list[Violation] = []
    out += _settled(rec)
    out += _rolled_back(rec)
    if rec.schedule.ordering == "key":
        out += _order(rec)
    out += _archived_once(rec)
    out += _twins(rec)
    out += _duplicates(rec)
    out += _logs(rec.logs)
    return out


def _received(rec: Record) -> dict[int, list[dict[str, Any]]]:
    got: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rec.journal:  # sorted by time
        if r["what"] == "delivered":
            got[r["n"]].append(r)
    return got


def _skipped(rec: Record) -> dict[int, float]:
    return {n: at for kind, at, ns in rec.actions if kind == "skip" for n in ns}


def _redriven(rec: Record) -> set[int]:
    return {n for kind, _, ns in rec.actions if kind == "redrive" for n in ns}


def _settled(rec: Record) -> list[Violation]:
    received = _received(rec)
    archived = set(rec.archived)
    committed = dict(rec.committed)
    committed |= {
        n: k for n, k in rec.uncertain.items() if n in archived or n in rec.dead or n in rec.pending
    }
    parked_keys: dict[str, int] = {}  # key -> its lowest parked dead letter
    for n, (_, parked) in rec.dead.items():
        if parked and n in committed:
            key = committed[n]
            parked_keys[key] = min(n, parked_keys.get(key, n))
    out = []
    for n, key in committed.items():
        if n in archived:
            if n not in received:
                out.append(
                    Violation("settled", f"event {n} ({key}) was archived, but the receiver never got it")
                )
            continue
        if n in rec.dead:
            continue
        if n in rec.pending and rec.schedule.on_dead == "park" and parked_keys.get(key, n) < n:
            continue
        where = "pending" if n in rec.pending else "nowhere"
        why = "" if rec.drained else " (the run did not drain within its time)"
        out.append(
            Violation("settled", f"event {n} ({key}) is neither archived nor dead-lettered: {where}{why}")
        )
    return out


def _rolled_back(rec: Record) -> list[Violation]:
    received = _received(rec)
    out = []
    for n in sorted(rec.rolled_back):
        if n in received or n in rec.archived or n in rec.dead:
            out.append(Violation("rolled back", f"event {n} was rolled back, yet sent"))
    return out


def _cleared(rec: Record, n: int, first: float | None) -> float:
    """When event ``n`` stopped blocking its key's later events."""
    s = rec.schedule
    times = [first] if first is not None else []
    if s.on_dead == "continue":
        # The relay moves past a dead letter once the receiver refused it, or it failed for the
        # last time: even when that batch's dead letter never committed (a crash after it), and
        # the event, claimed again, was delivered later.
        final = [
            r["replied"]
            for r in rec.journal
            if r["n"] == n
            and r["what"] in FAILED
            and (r["what"] == "refused" or r["attempts"] >= s.max_attempts - 1)
        ]
        times += final[:1]
    elif n in _skipped(rec):
        times.append(_skipped(rec)[n])
    return min(times) if times else float("inf")


def _order(rec: Record) -> list[Violation]:
    received = _received(rec)
    first = {n: rs[0]["t"] for n, rs in received.items()}
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for n, key in sorted(rec.committed.items()):
        by_key[key].append(n)
    out = []
    for key, ns in by_key.items():
        blocking: list[tuple[int, float]] = []  # earlier events and when each stopped blocking
        for n in ns:
            t = first.get(n)
            if t is not None:
                for m, cleared in blocking:
                    if cleared > t:
                        parked = m in rec.dead or m in _redriven(rec)
                        what = (
                            "while it was parked"
                            if parked and rec.schedule.on_dead == "park"
                            else "before it"
                        )
                        shown = "never" if cleared == float("inf") else f"at {cleared - rec.t0:.3f} s"
                        out.append(
                            Violation(
                                "order",
                                f"{key}: event {n} received at {t - rec.t0:.3f} s, {what}: event {m} "
                                f"(committed earlier) cleared {shown}",
                            )
                        )
                        break
            blocking.append((n, _cleared(rec, n, t)))
    return out


def _archived_once(rec: Record) -> list[Violation]:
    twice = [n for n, c in collections.Counter(rec.archived).items() if c > 1]
    return [
        Violation("archived once", f"event {n} archived {rec.archived.count(n)} times") for n in sorted(twice)
    ]


def _twins(rec: Record) -> list[Violation]:
    """Each twin outbox (its batches shared transactions with the checked one's): every event of
    a committed transaction archived once, none of a rolled back one, none left pending."""
    out = []
    for i, (archived, pending) in enumerate(zip(rec.twins_archived, rec.twins_pending, strict=True)):
        counts = collections.Counter(archived)
        twin = f"twin {i}: event"
        out += [Violation("archived once", f"{twin} {n} archived {c}×") for n, c in counts.items() if c > 1]
        out += [Violation("settled", f"{twin} {n} never archived") for n in rec.committed if n not in counts]
        out += [Violation("rolled back", f"{twin} {n} archived") for n in rec.rolled_back if n in counts]
        out += [Violation("settled", f"{twin} {n} still pending") for n in sorted(set(pending))]
    return out


def _lease_losses(logs: list[Path]) -> list[tuple[float, float | None]]:
    """(when, how long the batch had been out if the line says) of each lease lost, and of each
    batch rolled back with a transaction it shared (sent, not committed: sent again)."""
    out = []
    for entry in _log_entries(logs):
        sent_again = entry.get("event") in ("lease.lost", "batch.rolled_back")
        if sent_again or "grace budget spent" in entry.get("msg", ""):
            age = entry.get("batch_age")
            out.append((float(entry["ts"]), float(age) if age is not None else None))
    return out


def _duplicates(rec: Record) -> list[Violation]:
    s = rec.schedule
    windows = [(start - s.lease - 1.0, end + s.lease + 1.0) for _, _, start, end in rec.faults]
    # A batch whose lease was lost sent its events from its claim on: a key's chained sends, each
    # within the delivery timeout, can keep a batch out past lease + delivery timeout (seed 52:
    # 5.7 s against a 2.7 s lease; its first receipts fell before the window guessed from those).
    windows += [
        (t - max(s.lease + s.delivery_timeout, age or 0.0) - 1.0, t + 0.5)
        for t, age in _lease_losses(rec.logs)
    ]
    out = []
    for n, rs in sorted(_received(rec).items()):
        # Every receipt but one needs a reason: the relay had given up on it (a late ack), or it
        # was sent in a window where its batch's outcome could be lost.
        unexplained = [r for r in rs if not (r["late"] or any(a <= r["sent"] <= b for a, b in windows))]
        if len(unexplained) < 2:
            continue
        r = unexplained[1]
        out.append(
            Violation(
                "duplicate",
                f"event {n} received {len(rs)} times; at {unexplained[0]['t'] - rec.t0:.3f} s and again at "
                f"{r['t'] - rec.t0:.3f} s (relay {r['relay']}), outside every crash or lease-loss window",
            )
        )
    return out


def _log_entries(logs: list[Path]) -> list[dict[str, Any]]:
    entries = []
    for path in logs:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                entry["_log"] = path.name
                entries.append(entry)
    return entries


def _logs(logs: list[Path]) -> list[Violation]:
    seen: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    for entry in _log_entries(logs):
        if entry.get("level") not in ("warning", "error", "critical") or entry.get("event") == "event.dead":
            continue
        shape = re.sub(r"\d+(\.\d+)?", "#", entry.get("msg", ""))
        seen[(entry["_log"], shape)].append(float(entry["ts"]))
    out = []
    for (log, shape), times in seen.items():
        times.sort()
        for i in range(len(times) - LOG_REPEATS):
            if times[i + LOG_REPEATS] - times[i] <= LOG_WINDOW:
                out.append(
                    Violation(
                        "logs", f"{log}: {LOG_REPEATS + 1} lines in {LOG_WINDOW:g} s of {shape[:120]!r}"
                    )
                )
                break
    return out
