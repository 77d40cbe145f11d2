"""Same-run drains of one sink: relay (ordered), relay --ordering none, and the minimal loop."""

from __future__ import annotations

import json
import sys
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from statistics import median

from outbox.bench import sinks as S
from outbox.bench.contenders import ContenderSpec, drive
from outbox.config import RelayConfig
from outbox.relay import Relay
from outbox.routes import parse_routes
from outbox.sinks.make import routed


def unordered(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    config = RelayConfig(spec.dsn, schema=spec.schema, ordering="none")
    drive(Relay(config, routed(parse_routes([f"*={spec.sink_url}"], None), config)), counter, stop)


def main() -> None:
    S.CONTENDERS["unordered"] = unordered
    sink = sys.argv[1]
    n = int(sys.argv[2])
    rounds = int(sys.argv[3])
    kinds = ["relay", "unordered", "loop"]
    out = {k: [] for k in kinds}
    for r in range(rounds):
        for k in kinds[r % 3 :] + kinds[: r % 3]:
            d = S.drain_sink_once("host=127.0.0.1 port=5432 dbname=test user=root", sink, k, n, r, 600)
            out[k].append(d)
            print(k, json.dumps(d), flush=True)
    base = median(x["events_per_s"] for x in out["loop"])
    for k in kinds:
        rate = median(x["events_per_s"] for x in out[k])
        print(
            f"{k:10} {rate:9,.0f} {rate / base:5.2f} cpu/1k {median(x['cpu_s_per_1k'] for x in out[k]):.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
