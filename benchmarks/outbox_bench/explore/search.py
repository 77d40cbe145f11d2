"""Run schedules from a seed, shrink the first that fails, and say how to replay it."""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from outbox_bench.explore.checker import Violation, check
from outbox_bench.explore.schedule import Schedule, draw
from outbox_bench.explore.world import SINK, Record, World

Say = Callable[[str], None]
SHRINK_SHARE = 0.5  # of what is left of the budget, at most, for shrinking a failure
SHRINK_TRIES = 2  # runs of a smaller schedule before it counts as not failing


@dataclasses.dataclass
class Found:
    schedule: Schedule
    violations: list[Violation]
    record: Record


def play(world: World, schedule: Schedule, say: Say) -> tuple[Record, list[Violation]]:
    record = world.play(schedule, progress=lambda line: say(f"    {line}"))
    return record, check(record)


def search(world: World, first: int, schedules: int, budget: float, say: Say) -> Found | None:
    """Seeds ``first``, ``first + 1``, … until one fails, ``schedules`` ran, or ``budget`` seconds
    passed. Reports schedules per minute."""
    start = time.monotonic()
    ran = 0
    for seed in range(first, first + schedules):
        if ran and time.monotonic() - start > budget:
            break
        schedule = draw(seed)
        began = time.monotonic()
        record, violations = play(world, schedule, say)
        ran += 1
        took = time.monotonic() - began
        if violations:
            say(f"seed {seed}: {len(violations)} violations ({took:.1f} s)")
            return Found(schedule, violations, record)
        delivered = sum(1 for r in record.journal if r["what"] == "delivered")
        held = f"{len(record.committed)} events, {delivered} received, {took:.1f} s"
        say(f"seed {seed}: every invariant held ({held})")
    minutes = (time.monotonic() - start) / 60
    say(f"{ran} schedules in {minutes:.1f} min: {ran / max(minutes, 1e-9):.1f} schedules a minute")
    return None


def _smaller(s: Schedule) -> Iterator[tuple[Schedule, str]]:
    """Smaller schedules than ``s``, the likeliest to keep a failure first: fewer faults, freezes
    and actions, fewer events, fewer relays, fewer twin outboxes."""
    for i, f in enumerate(s.faults):
        yield s.without(faults=s.faults[:i] + s.faults[i + 1 :]), f"without the {f.kind} at {f.at:g} s"
    for i, z in enumerate(s.freezes):
        yield s.without(freezes=s.freezes[:i] + s.freezes[i + 1 :]), f"without the freeze at {z.at:g} s"
    for i, a in enumerate(s.actions):
        yield s.without(actions=s.actions[:i] + s.actions[i + 1 :]), f"without the {a.kind} at {a.at:g} s"
    if s.events > 50:
        yield (
            s.without(events=s.events // 2, write_for=max(1.0, round(s.write_for / 2, 2))),
            f"{s.events // 2} events",
        )
    if s.relays > 1 and all(f.relay < s.relays - 1 for f in s.faults):
        yield s.without(relays=s.relays - 1), f"{s.relays - 1} relays"
    if s.twins:
        yield s.without(twins=s.twins - 1), f"{s.twins - 1} twin outboxes"


def shrink(world: World, found: Found, budget: float, say: Say) -> Found:
    """The smallest schedule found, within ``budget`` seconds, that still breaks the same invariant."""
    deadline = time.monotonic() + budget
    wanted = found.violations[0].invariant
    better = True
    while better and time.monotonic() < deadline:
        better = False
        for candidate, what in _smaller(found.schedule):
            if time.monotonic() >= deadline:
                break
            for _ in range(SHRINK_TRIES):
                record, violations = play(world, candidate, say)
                if any(v.invariant == wanted for v in violations):
                    notes = (*found.schedule.notes, f"shrunk: {what}")
                    found = Found(candidate.without(notes=notes), violations, record)
                    say(f"  still fails {what}")
                    better = True
                    break
            if better:
                break
    return found


def report(found: Found, out: Path, relay_sink: str = SINK) -> str:
    """The failure as the user sees it: seed, schedule, first violation, and the replay command."""
    s = found.schedule
    path = out / f"schedule-{s.seed}.json"
    path.write_text(s.to_json())
    replay = (
        f"outbox bench explore --seed {s.seed}" if not s.notes else f"outbox bench explore --schedule {path}"
    )
    if relay_sink != SINK:
        replay += f" --relay-sink {relay_sink}"
    first = found.violations[0]
    counts = collections.Counter(v.invariant for v in found.violations)
    tally = ", ".join(f"{name} {n}" for name, n in counts.items())
    return "\n".join(
        [
            f"seed {s.seed}: an invariant broke ({tally})",
            s.render(),
            f"first violation: {first}",
            f"replay: {replay}",
        ]
    )
