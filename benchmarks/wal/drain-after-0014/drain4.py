"""Interleaved drain: relay, relay_wal, ceiling, ceiling_wal; prints events/s and CPU per 1k."""
import json, sys
from dataclasses import replace
from statistics import median
from outbox.bench.config import BenchConfig
from outbox.bench.scenarios import DRAIN_CASES, drain_once, rotated
from outbox.harness.infra import infrastructure

def main() -> None:
    names = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("relay", "relay_wal", "ceiling", "ceiling_wal")
    events = int(sys.argv[1]) if len(sys.argv) > 1 else 300_000
    repeat = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    with infrastructure("postgresql://root@127.0.0.1:5432/test", None) as infra:
        cfg = BenchConfig(dsn=infra.dsn, bootstrap=infra.bootstrap, events=events)
        out = {n: [] for n in names}
        for r in range(repeat):
            for n in rotated(names, r):
                d = drain_once(cfg, DRAIN_CASES[0], n, r)
                d.pop("series")
                out[n].append(d)
                print(json.dumps(d), flush=True)
        base = median(x["events_per_s"] for x in out[names[0]])
        for n, rs in out.items():
            m = median(x["events_per_s"] for x in rs)
            cpu = {k: median(x[k] for x in rs) for k in ("relay_cpu_s_per_1k", "postgres_cpu_s_per_1k", "broker_cpu_s_per_1k")}
            print(f"{n:14} {m:10,.0f} {m/base:5.2f} {cpu}", flush=True)


if __name__ == "__main__":
    main()
