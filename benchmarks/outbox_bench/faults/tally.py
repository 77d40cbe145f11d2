"""The verdict: account for every committed event. Pure, so it is tested on its own."""

from __future__ import annotations

from typing import Any

from outbox.harness.load import Written
from outbox.harness.tap import Seen


def tally(
    *,
    committed: list[Written],
    unsure: list[Written],
    expected_dead: list[Written],
    seen: list[Seen],
    archived: dict[str, int],
    dead: dict[str, int],
    pending: set[str],
    fault_end: float | None,
) -> dict[str, Any]:
    """Account for every committed event. Pure: the harness's verdict, testable on its own.

    ``archived`` maps event id -> archive rows, ``dead`` event id -> attempts,
    ``seen`` is what the consumer read, in order.
    """
    in_db = set(archived) | set(dead) | pending
    by_id = {w.event_id: w for w in committed}
    unsure_committed = [w for w in unsure if w.event_id in in_db]
    by_id.update({w.event_id: w for w in unsure_committed})
    by_id.update({w.event_id: w for w in expected_dead})
    poison = {w.event_id for w in expected_dead}
    first_seen: dict[str, float] = {}
    for m in seen:
        first_seen.setdefault(m.event_id, m.at)

    lost = [e for e in by_id if e not in first_seen and e not in dead]
    phantoms = [e for e in first_seen if e not in by_id]  # on the broker, never committed
    unexpected_dead = [e for e in dead if e not in poison]
    poison_not_dead = [e for e in poison if e not in dead]
    poison_retried = [e for e in poison if dead.get(e, 1) > 1]
    double_archived = sum(1 for n in archived.values() if n > 1)
    unarchived = [e for e in by_id if e not in archived and e not in dead]

    # Per-key order, in the broker's log order, after keeping first occurrences: each
    # key's sequence must rise. (Log order, not arrival order: a record the live read
    # skipped and a re-read found arrives late but sits where the relay put it.)
    last: dict[str, int] = {}
    firsts: set[str] = set()
    violations = 0
    examples: list[str] = []  # the first few, to tell one cause from another in a failed run
    for m in sorted(seen, key=lambda m: m.log):  # stable: equal positions keep arrival order
        if m.event_id in firsts or m.event_id not in by_id:
            continue
        firsts.add(m.event_id)
        if m.seq <= last.get(m.key, 0):
            violations += 1
            if len(examples) < 5:
                examples.append(f"{m.key} #{m.seq} after #{last[m.key]}")
        last[m.key] = m.seq

    recover: float | None = None
    if fault_end is not None:
        before = [e for e, w in by_id.items() if w.at <= fault_end and e not in poison]
        arrivals = [first_seen[e] for e in before if e in first_seen]
        if arrivals and len(arrivals) == len(before):
            recover = max(0.0, max(arrivals) - fault_end)

    ok = not (lost or violations or double_archived or unarchived or unexpected_dead)
    ok = ok and not (poison_not_dead or poison_retried or phantoms)
    return {
        "committed": len(by_id),
        "delivered": len([e for e in first_seen if e in by_id]),
        "archived": len(archived),
        "dead_lettered": len(dead),
        "duplicates": len(seen) - len(first_seen),
        "lost": len(lost),
        "order_violations": violations,
        "order_examples": examples,
        "recover_seconds": recover,
        "double_archived": double_archived,
        "unarchived": len(unarchived),
        "unexpected_dead": len(unexpected_dead),
        "poison": len(poison),
        "poison_not_dead": len(poison_not_dead),
        "poison_retried": len(poison_retried),
        "phantoms": len(phantoms),
        "unsure_commits": len(unsure),
        "unsure_committed": len(unsure_committed),
        "ok": ok,
    }
