"""The benchmark's settings (light: the CLI reads them before it checks for psutil and matplotlib)."""

from __future__ import annotations

from dataclasses import dataclass

from outbox.settings import setting


@dataclass
class BenchConfig:
    dsn: str = setting(help="PostgreSQL", cli=False)
    bootstrap: str = setting(help="the broker", cli=False)
    events: int = setting(300_000, "drain/scale: pending events")
    big_events: int = setting(1_000_000, "drain: pending events of the larger backlog (0: skip it)")
    repeat: int = setting(3, "drain: runs per contender")
    seeds_seconds: float = setting(
        30.0,
        "drain: seconds the hand-written loop (one event a transaction) races (it is slow)",
    )
    peer_seconds: float = setting(30.0, "drain: seconds each Python peer races (outbox-relay-bench[peers])")
    rates: list[int] = setting(default_factory=lambda: [200, 500, 1000], help="steady: events/s")
    steady_seconds: float = setting(30.0, "steady: seconds per rate and contender")
    steady_repeat: int = setting(3, "steady: runs per rate of the relay and of the minimal loop, interleaved")
    writer_iterations: int = setting(2000, "writer: business transactions with and without enqueue")
    enqueue_many_repeats: int = setting(30, "writer: enqueue_many(1000) calls")
    soak_minutes: float = setting(10.0, "soak: minutes")
    soak_rate: int = setting(2000, "soak: events/s")
    snapshot_seconds: float = setting(60.0, "soak: seconds a snapshot is held open")
    settle_seconds: float = setting(90.0, "soak: seconds allowed afterwards for the table to shrink")
    snapshot_minutes: float = setting(
        10.0, "snapshot: minutes of writes under a held snapshot, per capture mode"
    )
    snapshot_rate: int = setting(2000, "snapshot: events/s written meanwhile")
    snapshot_control: bool = setting(
        True,
        "snapshot: run each capture mode again with no snapshot held, the same minutes (the "
        "machine's own minute-to-minute variation, to judge the held run's against)",
    )
    scale_processes: list[int] = setting(default_factory=lambda: [1, 2, 4], help="scale: relay processes")
    sinks: list[str] = setting(
        default_factory=lambda: [
            "amqp://guest:guest@127.0.0.1:5672/",
            "nats://127.0.0.1:4222",
            "redis://127.0.0.1:6379/0",
            "http",
        ],
        help="sinks: a sink URL to drain, repeatable (in the variable: separated by whitespace); "
        "http: a receiver of the bench's own",
        metavar="URL",
    )
    sink_events: int = setting(100_000, "sinks: pending events per drain")
    console_pending: int = setting(1_000_000, "console: pending events")
    console_dead: int = setting(100_000, "console: dead letters")
    console_dead_keys: int = setting(10_000, "console: keys the dead letters are on (each parked)")
    console_archived: int = setting(10_000_000, "console: archived events")
    console_days: int = setting(7, "console: days the archived events were delivered over")
    console_requests: int = setting(20, "console: timed requests per page")
    tenants_events: int = setting(200_000, "tenants: the backlog spread over the outboxes")
    tenants_counts: list[int] = setting(
        default_factory=lambda: [1, 10, 100, 1000], help="tenants: outboxes the backlog is spread over"
    )
    tenants_idle_seconds: float = setting(
        10.0, "tenants: seconds the relay idles after a drain (its idle cost)"
    )
    tenants_busy: int = setting(1_000_000, "tenants: the busy outbox's backlog in the fairness run")
    tenants_quiet_rate: int = setting(10, "tenants: events/s written to the quiet outbox meanwhile")
    limits_fast: int = setting(100_000, "limits: events to the unlimited route (Kafka)")
    limits_slow: int = setting(2_000, "limits: events to the limited route (a webhook), written first")
    limits_rate: float = setting(100.0, "limits: the limited route's rate, events/s")
    limits_seconds: float = setting(15.0, "limits: seconds of the two relays' limited drain")
    limits_pairs: int = setting(3, "limits: pairs of drains, without and with the limited backlog")
    limits_weight_events: int = setting(60_000, "limits: each weighted outbox's backlog")
    verify_events: int = setting(1_000_000, "verify: events delivered, then read back by outbox verify")
    verify_drain_events: int = setting(200_000, "verify: each drain's backlog, alone and beside a read-back")
    max_race_seconds: float = setting(600.0, "longest a race may run", cli=False)


# What `outbox bench` (perf) can run, in the order it runs them.
SCENARIOS = (
    "drain", "steady", "snapshot", "writer", "soak", "scale", "sinks", "console", "tenants", "limits",
    "verify",
)  # fmt: skip

# --smoke: every scenario in seconds (CI checks that each runs and writes its outputs).
SMOKE = {
    "events": 3000,
    "verify_events": 3000,
    "verify_drain_events": 3000,
    "big_events": 6000,
    "repeat": 1,
    # Time-boxed races count from their first event moved (a slow spawn on a loaded machine is
    # not in them): 1.5 s is 30 samples of the 50 ms counter, and each box burns CPU flat out, in
    # a parallel test suite on two cores.
    "seeds_seconds": 1.5,
    "peer_seconds": 1.5,
    "rates": [200],
    "steady_seconds": 3.0,
    "steady_repeat": 1,
    "writer_iterations": 100,
    "enqueue_many_repeats": 3,
    "soak_minutes": 0.05,
    "soak_rate": 200,
    "snapshot_seconds": 1.0,
    "snapshot_minutes": 0.05,
    "snapshot_rate": 200,
    "settle_seconds": 3.0,
    "scale_processes": [1, 2],
    "sink_events": 2000,
    "console_pending": 3000,
    "console_dead": 500,
    "console_dead_keys": 50,
    "console_archived": 20_000,
    "console_days": 2,
    "console_requests": 3,
    "tenants_events": 2000,
    "tenants_counts": [1, 10],
    "tenants_idle_seconds": 2.0,
    "tenants_busy": 6000,
    "limits_fast": 3000,
    "limits_slow": 50,
    "limits_rate": 50.0,
    "limits_seconds": 2.0,
    "limits_pairs": 1,
    "limits_weight_events": 3000,
}
