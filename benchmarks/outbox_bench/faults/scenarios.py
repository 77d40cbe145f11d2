"""The scenarios, in one table: each row is a fault, how long it runs, how the relays
run for it, and what it must have provoked — a fault that did not happen proves nothing."""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from outbox.observe.progress import Progress
from outbox.relay.config import DELIVERY_TIMEOUT, LEASE, STALL_TIMEOUT
from outbox_bench.faults.config import FaultConfig
from outbox_bench.faults.relays import poll_until
from outbox_bench.faults.run import MiB, Run
from outbox_bench.harness.proxy import Proxy
from outbox_bench.queries import query

Body = Callable[[Run, Progress], None]
BACKLOG_DRAINED = 100  # pending events under which a healed blackhole counts as drained


def _kill(run: Run, p: Progress) -> None:
    """Relays SIGKILLed in turn every few seconds and restarted at once."""
    cfg = run.cfg
    run.sleep(cfg.warmup, p, window="warmup")
    window = run.window("kills", cfg.kill_window)
    kills = 0
    while window.open():
        victim = kills % cfg.relays
        run.relays.restart(victim)
        kills += 1
        run.mark(f"SIGKILL relay {victim}, restarted")
        run.sleep(cfg.kill_every * random.uniform(0.7, 1.3), p)
    window.close()
    run.fault_end = time.time()
    run.notes["kills"] = kills
    run.sleep(cfg.tail, p, window="tail")


def _pg_restart(run: Run, p: Progress) -> None:
    """PostgreSQL restarted (fast: every session ended) while relays and writers run."""
    cfg = run.cfg
    assert cfg.restart_pg is not None
    run.sleep(cfg.warmup, p, window="warmup")
    t = time.time()
    cfg.restart_pg()
    run.mark(f"PostgreSQL restarted ({time.time() - t:.1f} s)")
    run.fault_end = time.time()
    run.sleep(cfg.tail * 2, p, window="tail")


def _terminate(run: Run, p: Progress) -> None:
    """The relays' sessions killed with pg_terminate_backend, mid-batch, three times."""
    cfg = run.cfg
    run.sleep(cfg.warmup, p, window="warmup")
    total = mid = 0
    for _ in range(3):
        with psycopg.connect(cfg.dsn, autocommit=True) as conn:
            rows = conn.execute(query("harness_terminate_relays", run.schema)).fetchall()
        in_tx = sum(
            1 for _, state in rows if (state or "").startswith("idle in transaction") or state == "active"
        )
        total += len(rows)
        mid += in_tx
        run.mark(f"terminated {len(rows)} relay sessions ({in_tx} mid-transaction)")
        run.sleep(max(1.0, cfg.kill_every), p)
    run.fault_end = time.time()
    run.notes["terminated"] = total
    run.notes["terminated_mid_transaction"] = mid
    run.sleep(cfg.tail, p, window="tail")


def _broker(run: Run, p: Progress) -> None:
    """The broker stopped for a while, then started again empty."""
    cfg = run.cfg
    assert cfg.stop_broker is not None and cfg.start_broker is not None
    run.sleep(cfg.warmup, p, window="warmup")
    for pid in run.relays.pids():  # freeze producers so the consumer can read all that was acked
        os.kill(pid, signal.SIGSTOP)
    caught_up = run.tap.caught_up(10)
    cfg.stop_broker()
    for pid in run.relays.pids():
        os.kill(pid, signal.SIGCONT)
    run.mark(f"broker stopped (consumer caught up first: {caught_up})")
    run.sleep(cfg.broker_outage, p, window="broker outage")
    cfg.start_broker()
    run.tap.reset()
    run.mark("broker started (empty)")
    run.fault_end = time.time()
    run.notes["check"] = caught_up
    run.sleep(cfg.tail * 2, p, window="tail")


def _slow_sink(run: Run, p: Progress) -> None:
    """Each relay's acks come later than its lease for a window: the other relay takes over."""
    cfg = run.cfg
    run.sleep(cfg.warmup + cfg.lease * 3 + cfg.tail, p, window="late-ack windows")
    run.fault_end = run.started + cfg.warmup + cfg.lease * 2
    run.mark("late-ack windows over")
    run.sleep(cfg.tail, p, window="tail")


def _snapshot(run: Run, p: Progress) -> None:
    """Another session holds a snapshot open: vacuum can remove nothing meanwhile."""
    cfg = run.cfg
    run.sleep(cfg.warmup, p, window="warmup")
    before = run.throughput(time.time() - cfg.warmup + 1, time.time())
    size_before = run.monitor.samples[-1][3] if run.monitor.samples else 0
    with psycopg.connect(cfg.dsn) as holder:
        holder.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        holder.execute(query("harness_count_orders", run.schema))
        held_at = time.time()
        run.mark("snapshot taken")
        run.sleep(cfg.snapshot_seconds, p, window="snapshot held")
        released = time.time()
    run.mark("snapshot released")
    run.fault_end = released
    run.sleep(cfg.tail * 2, p, window="tail")
    during = run.throughput(held_at, released)
    after = run.throughput(released, time.time())
    window = [s for s in run.monitor.samples if held_at <= s[0] <= released]
    run.notes.update(
        rate_before=round(before, 1),
        rate_during=round(during, 1),
        rate_after=round(after, 1),
        table_before_mib=round(size_before / MiB, 2),
        table_held_peak_mib=round(max((s[3] for s in window), default=0) / MiB, 2),
    )


def _poison(run: Run, p: Progress) -> None:
    """Events no broker accepts, among good ones: dead-lettered at the first attempt."""
    cfg = run.cfg
    run.sleep(cfg.warmup, p, window="warmup")
    end = time.monotonic() + cfg.poison_window
    while time.monotonic() < end:
        run.expected_dead.extend(run.writers.poison(2))
        run.sleep(1.0, p)
    run.mark(f"{len(run.expected_dead)} poison events committed")
    run.fault_end = time.time()
    run.sleep(cfg.tail, p, window="tail")


def _sink_outage(run: Run, p: Progress) -> None:
    """The sink unreachable (connections reset, new ones refused) for a while, then back."""
    cfg = run.cfg
    assert run.proxy is not None
    run.sleep(cfg.warmup, p, window="warmup")
    run.proxy.refuse()
    run.mark(f"sink {run.tap.scheme} refused")
    run.sleep(cfg.broker_outage, p, window="sink refused")
    run.proxy.heal()
    run.mark(f"sink {run.tap.scheme} back")
    run.fault_end = time.time()
    run.sleep(cfg.tail * 2, p, window="tail")


def _blackhole(
    run: Run,
    p: Progress,
    proxy: Proxy,
    what: str,
    drain_within: float | None = None,
    at_least: float = 0.0,
) -> None:
    """Traffic frozen (sockets open, no bytes, no reset) for the blackhole's seconds (or
    ``at_least``), then healed: each relay's /readyz must turn 503 and /livez stay 200;
    measured: time to not-ready, time to drained after healing (which must be at most
    ``drain_within`` seconds, if given)."""
    cfg = run.cfg
    run.sleep(cfg.warmup, p, window="warmup")
    proxy.freeze()
    frozen = time.time()
    run.mark(f"{what} blackholed")
    not_ready: dict[int, float] = {}
    live = True
    window = run.window("blackhole", max(cfg.blackhole_seconds, at_least))
    while window.open():
        for i in range(cfg.relays):
            if i not in not_ready and run.relays.get(i, "/readyz")[0] == 503:
                not_ready[i] = time.time() - frozen
                run.mark(f"relay {i} /readyz 503 after {not_ready[i]:.1f} s")
            live = live and run.relays.get(i, "/livez")[0] == 200
        run.sleep(0.5, p)
    window.close()
    proxy.heal()
    healed = time.time()
    run.mark(f"{what} healed")
    pending = [run.monitor.samples[-1][1] if run.monitor.samples else -1]

    def drained() -> bool:
        samples = [s for s in run.monitor.samples if s[0] > healed]
        pending[0] = samples[-1][1] if samples else -1
        return 0 <= pending[0] < BACKLOG_DRAINED

    ok = poll_until(drained, cfg.drain_timeout, interval=0.25)
    run.fault_end = time.time()
    run.mark(f"backlog under {BACKLOG_DRAINED}: {ok}")
    # Each relay must turn not ready; in WAL capture, the one that reads the slot: the others
    # stand by with nothing in flight, so nothing tells them the sink is frozen.
    needed = 1 if cfg.capture == "wal" and what.startswith("sink") else cfg.relays
    run.notes.update(
        not_ready_seconds=round(max(not_ready.values()), 1) if len(not_ready) >= needed else None,
        relays_not_ready=len(not_ready),
        livez_200_throughout=live,
        drained_seconds=round(run.fault_end - healed, 1) if ok else None,
    )
    if drain_within is not None:
        run.notes["drain_target_seconds"] = drain_within
        run.notes["check"] = ok and run.fault_end - healed <= drain_within
    run.sleep(cfg.tail, p, window="tail")


def _blackhole_pg(run: Run, p: Progress) -> None:
    """The relays' PostgreSQL traffic frozen (writers still commit), then healed."""
    assert run.pg_proxy is not None
    _blackhole(run, p, run.pg_proxy, "PostgreSQL")


def _blackhole_sink(run: Run, p: Progress) -> None:
    """The sink's traffic frozen (sockets open, nothing moves), then healed. Frozen for at least
    the relays' delivery timeout and stall timeout and a margin: a sink whose client times the
    frozen calls out (the AWS SDK, at the delivery timeout) reports each as failed, and /readyz
    turns once every attempt has failed for the stall timeout. With the relay's own 15 s, the
    short run's 18 s freeze was over before that on a loaded machine (Kinesis, in CI)."""
    assert run.proxy is not None
    _blackhole(run, p, run.proxy, f"sink {run.tap.scheme}", run.cfg.sink_healed_drain, _sink_frozen(run.cfg))


def _sink_frozen(cfg: FaultConfig) -> float:
    """The least a sink's blackhole lasts (see _blackhole_sink)."""
    return cfg.delivery_timeout + STALL_TIMEOUT + 3


def _relay_defaults(cfg: FaultConfig) -> dict[str, Any]:
    """The relay's own lease and delivery timeout, as users run them."""
    return {"lease": LEASE, "delivery_timeout": DELIVERY_TIMEOUT}


def _blackhole_sink_provoked(r: dict[str, Any]) -> bool:
    """Not ready, drained once healed, and on Kafka: a producer given up, past its deadline
    during the freeze (its messages, unreported, sent again in order) or fenced after it."""
    given_up = r["sink"] != "kafka" or r["producers_past_deadline"] + r["producers_lost"] >= 1
    return r["not_ready_seconds"] is not None and r["drained_seconds"] is not None and given_up


def _sigstop(run: Run, p: Progress) -> None:
    """One relay frozen past its batch and ownership leases, then resumed.

    Frozen only once it owns partitions, so that the others must take them over;
    after SIGCONT, the run waits until the resumed relay has noticed the loss.
    """
    cfg = run.cfg
    run.sleep(cfg.warmup, p, window="warmup")
    owns = poll_until(lambda: run.relays.metric(0, "outbox_owned_partitions") > 0, cfg.ready_timeout)
    frozen = max(cfg.lease, cfg.ownership_lease) + 3
    run.relays.signal(0, signal.SIGSTOP)
    run.mark(f"SIGSTOP relay 0 for {frozen:.0f} s (it owned partitions: {owns})")
    run.sleep(frozen, p, window="relay 0 frozen")
    run.relays.signal(0, signal.SIGCONT)
    run.mark("SIGCONT relay 0")
    run.fault_end = time.time()
    noticed = poll_until(
        lambda: run.relays.metric(0, "outbox_partitions_lost_total") > 0, cfg.ownership_lease * 3 + 5
    )
    run.mark(f"relay 0 noticed its partitions were taken: {noticed}")
    run.notes["check"] = owns
    run.sleep(cfg.tail * 2, p, window="tail")


def _soak(run: Run, p: Progress) -> None:
    """A long steady run: relay restarted twice (SIGTERM, SIGKILL) and PostgreSQL once."""
    cfg = run.cfg
    assert cfg.restart_pg is not None
    quarter = cfg.soak_seconds / 4
    run.sleep(quarter, p, window="quarter")
    run.relays.restart(0, graceful=True)
    run.mark("relay 0 restarted (SIGTERM)")
    run.sleep(quarter, p, window="quarter")
    cfg.restart_pg()
    run.mark("PostgreSQL restarted")
    run.sleep(quarter, p, window="quarter")
    run.relays.restart(1 % cfg.relays)
    run.mark(f"relay {1 % cfg.relays} restarted (SIGKILL)")
    run.fault_end = time.time()
    run.sleep(quarter, p, window="quarter")


def _no_args(cfg: FaultConfig) -> list[str]:
    return []


def _no_env(cfg: FaultConfig) -> dict[str, str]:
    return {}


def _no_settings(cfg: FaultConfig) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Scenario:
    body: Body
    seconds: Callable[[FaultConfig], float]  # planned, for the progress bar
    provoked: Callable[[dict[str, Any]], bool]  # what must have happened, or the run proved nothing
    relay_args: Callable[[FaultConfig], list[str]] = _no_args
    relay_env: Callable[[FaultConfig], dict[str, str]] = _no_env
    settings: Callable[[FaultConfig], dict[str, Any]] = _no_settings  # the scenario's own FaultConfig
    needs: frozenset[str] = field(default_factory=frozenset)  # "restart_pg", "restart_broker"
    sinks: str = "any"  # "kafka": only against Kafka; "other": only with --sink

    @property
    def about(self) -> str:
        return (self.body.__doc__ or "").strip().splitlines()[0]


SCENARIOS: dict[str, Scenario] = {
    "kill": Scenario(
        _kill,
        lambda c: c.warmup + c.kill_window + c.tail,
        lambda r: r["kills"] >= 3 and r["relay_starts"] >= 5,
    ),
    "pg-restart": Scenario(
        _pg_restart,
        lambda c: c.warmup + 2 * c.tail,
        lambda r: r["reconnects"] + r["writer_errors"] > 0,
        needs=frozenset({"restart_pg"}),
    ),
    "terminate": Scenario(
        _terminate,
        lambda c: c.warmup + 3 * max(1.0, c.kill_every) + c.tail,
        lambda r: r["terminated"] >= 3,
    ),
    "broker": Scenario(
        _broker,
        lambda c: c.warmup + c.broker_outage + 2 * c.tail,
        lambda r: r["producers_recreated"] >= 1,
        needs=frozenset({"restart_broker"}),
        sinks="kafka",
    ),
    "sink-outage": Scenario(
        _sink_outage,
        lambda c: c.warmup + c.broker_outage + 2 * c.tail,
        lambda r: r["sink_outages"] >= 1,
        sinks="other",
    ),
    "slow-sink": Scenario(
        _slow_sink,
        lambda c: c.warmup + 3 * c.lease + 2 * c.tail,
        lambda r: r["stale_acks_refused"] >= 1,
        relay_args=lambda c: ["--sink", "outbox_bench.faults.sinks:late_acks"],
        sinks="kafka",
        relay_env=lambda c: {
            "OUTBOX_FAULT_LATE_AFTER": str(c.warmup),
            "OUTBOX_FAULT_LATE_WINDOW": str(c.lease),
            "OUTBOX_FAULT_LATE_DELAY": str(c.lease * 1.5),
        },
    ),
    "snapshot": Scenario(
        _snapshot,
        lambda c: c.warmup + c.snapshot_seconds + 2 * c.tail,
        lambda r: r["table_held_peak_mib"] > 0,
    ),
    "poison": Scenario(
        _poison,
        lambda c: c.warmup + c.poison_window + c.tail,
        lambda r: r["poison"] >= 2 and r["dead_lettered"] == r["poison"],
        sinks="kafka",
    ),
    "sigstop": Scenario(
        _sigstop,
        lambda c: c.warmup + max(c.lease, c.ownership_lease) + 3 + 2 * c.tail,
        lambda r: r["ownership_lost"] >= 1,  # the resumed relay found its partitions taken
    ),
    "blackhole-pg": Scenario(
        _blackhole_pg,
        lambda c: c.warmup + c.blackhole_seconds + 20 + c.tail,
        lambda r: r["not_ready_seconds"] is not None and r["drained_seconds"] is not None,
    ),
    "blackhole-sink": Scenario(  # Kafka: a broker of the run's own, behind the proxy (run.py)
        _blackhole_sink,
        lambda c: c.warmup + max(c.blackhole_seconds, _sink_frozen(c)) + c.sink_healed_drain + c.tail,
        _blackhole_sink_provoked,
        settings=_relay_defaults,
    ),
    "soak": Scenario(
        _soak,
        lambda c: c.soak_seconds,
        lambda r: r["relay_starts"] >= 4 and "PostgreSQL restarted" in str(r["timeline"]),
        needs=frozenset({"restart_pg"}),
    ),
}


def run_scenario(cfg: FaultConfig, name: str) -> dict[str, Any]:
    scenario = SCENARIOS[name]
    cfg = replace(cfg, **scenario.settings(cfg))
    run = Run(cfg, name, scenario.relay_args(cfg), scenario.relay_env(cfg))
    p = Progress(name, scenario.seconds(cfg), "s")
    try:
        with run.load():
            scenario.body(run, p)
        p.close(run.status() + " — draining")
        drained = run.drain()
        result = run.account(drained)
    except BaseException:
        run.relays.stop_all()  # no relay outlives the harness
        run.close()
        raise
    run.close()
    result["rate"] = cfg.rate
    result["sink"] = run.tap.scheme if cfg.sink else "kafka"
    result["schema"] = run.schema
    # A load window short of its commits (Window) met too few writes to prove anything.
    result["provoked"] = bool(scenario.provoked(result)) and not result["short_windows"]
    result["passed"] = drained and result["ok"] and result.get("check", True) and result["provoked"]
    if result["passed"]:
        run.teardown()  # a failed run's schema stays, for its rows and last_error
    return result
