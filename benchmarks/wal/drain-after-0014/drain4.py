"""Interleaved drains of the bench's realistic case: table relay, WAL relay and their ceilings.

Usage: python drain4.py [EVENTS] [CONTENDER,...] [REPEAT]; prints each run as JSON, then the
medians, each contender's ratio to the first, and its CPU per 1,000 events.
"""

from __future__ import annotations

import json
import sys
from statistics import median
from typing import Any

from outbox.bench.config import BenchConfig
from outbox.bench.scenarios import DRAIN_CASES, drain_once, rotated
from outbox.harness.infra import infrastructure

CPU = ("relay_cpu_s_per_1k", "postgres_cpu_s_per_1k", "broker_cpu_s_per_1k")


def main() -> None:
    events = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    default = ("relay", "relay_wal", "ceiling", "ceiling_wal")
    names = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else default
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    with infrastructure("postgresql://root@127.0.0.1:5432/test", None) as infra:
        cfg = BenchConfig(dsn=infra.dsn, bootstrap=infra.bootstrap, events=events)
        out: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for r in range(repeat):
            for n in rotated(names, r):
                d = drain_once(cfg, DRAIN_CASES[0], n, r)
                d.pop("series")
                out[n].append(d)
                print(json.dumps(d), flush=True)
    base = median(x["events_per_s"] for x in out[names[0]])
    for n, runs in out.items():
        rate = median(x["events_per_s"] for x in runs)
        cpu = {k: median(x[k] for x in runs) for k in CPU}
        print(f"{n:14} {rate:10,.0f} {rate / base:5.2f} {cpu}", flush=True)


if __name__ == "__main__":  # the contenders are spawned processes: they import this module
    main()
