"""Summarise the traces sitecustomize.py wrote for one steady run (notify on, notify off, WAL).

python stages.py DIR        # p50 of each stage, table capture (NOTIFY) and WAL capture
python stages.py DIR loop   # also: what the loop was doing when each event arrived
"""

from __future__ import annotations

import bisect
import collections
import glob
import sys

Events = dict[str, dict[str, float]]


def p50(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2] if values else float("nan")


def load(directory: str) -> tuple[dict[str, float], list[tuple[str, Events]]]:
    commits: dict[str, float] = {}
    for path in glob.glob(f"{directory}/commits-*.txt"):
        for line in open(path):
            _, event_id, at = line.split()
            commits[event_id] = float(at)
    runs = []
    for path in sorted(glob.glob(f"{directory}/trace-*.txt"), key=lambda p: int(p.rsplit("-", 1)[1][:-4])):
        events: Events = {}
        for line in open(path):
            stage, event_id, at = line.split()
            if event_id in commits:
                events.setdefault(event_id, {}).setdefault(stage, float(at))
        runs.append((path.rsplit("-", 1)[1][:-4], events))
    return commits, runs


def stage(events: Events, commits: dict[str, float], a: str, b: str) -> float:
    return p50(
        [
            (e[b] - (commits[i] if a == "commit" else e.get(a, float("nan")))) * 1e3
            for i, e in events.items()
            if b in e and (a == "commit" or a in e)
        ]
    )


def loop(directory: str, pid: str, events: Events, commits: dict[str, float]) -> None:
    spans = []
    for line in open(f"{directory}/loop-{pid}.txt"):
        name, a, b = line.split()
        if name != "_step":
            spans.append((float(a), float(b), name))
    spans.sort()
    starts = [s[0] for s in spans]
    total: collections.Counter[str] = collections.Counter()
    for a, b, name in spans:
        total[name] += b - a
    length = spans[-1][1] - spans[0][0]
    print("  the loop's time:", ", ".join(f"{n} {v / length:.0%}" for n, v in total.most_common()))
    waits: dict[str, list[float]] = collections.defaultdict(list)
    for event_id, e in events.items():
        arrived = e.get("read", commits[event_id])
        if "start" not in e:
            continue
        j = bisect.bisect_right(starts, arrived) - 1
        inside = [s for s in spans[max(0, j - 5) : j + 1] if s[0] <= arrived <= s[1]]
        name = min(inside, key=lambda s: s[1] - s[0])[2] if inside else "between calls"
        waits[name].append((e["start"] - arrived) * 1e3)
    for name, w in sorted(waits.items(), key=lambda kv: -len(kv[1])):
        print(f"  arrived during {name:<26} {len(w):5d} events, p50 {p50(w):.2f} ms before claimed or taken")


def main() -> None:
    directory = sys.argv[1]
    commits, runs = load(directory)
    (on_pid, on), (wal_pid, wal) = runs[0], runs[-1]
    table = [
        ("commit", "start", "commit -> claim"),
        ("start", "produce", "claim"),
        ("produce", "ack", "produce -> ack"),
    ]
    table.append(("commit", "ack", "commit -> ack"))
    print("table (NOTIFY):", ", ".join(f"{n} {stage(on, commits, a, b):.2f}" for a, b, n in table), "ms")
    steps = [
        ("commit", "read", "commit -> read"),
        ("read", "take", "read -> taken"),
        ("start", "produce", "key check"),
    ]
    steps += [("produce", "ack", "produce -> ack"), ("commit", "ack", "commit -> ack")]
    print("WAL:", ", ".join(f"{n} {stage(wal, commits, a, b):.2f}" for a, b, n in steps), "ms")
    if sys.argv[2:] == ["loop"]:
        for label, pid, events in (("table (NOTIFY)", on_pid, on), ("WAL", wal_pid, wal)):
            print(label)
            loop(directory, pid, events, commits)


if __name__ == "__main__":
    main()
