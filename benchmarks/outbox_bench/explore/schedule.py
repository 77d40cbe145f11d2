"""A schedule: everything one exploration run does, drawn from a seed.

The same seed draws the same schedule on every machine (``random.Random(seed)``, and nothing
else: no clock, no hash of a ``str`` that PYTHONHASHSEED changes), and :meth:`Schedule.render`
prints it as the same text. Times are seconds after the writer starts.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

SERIAL_BUDGET = 12.0  # seconds
# The relays' --poll-interval (world.py): a key's failed send is claimed again no sooner than its
# backoff, and the claim that takes it comes with the next poll.
POLL_INTERVAL = 0.2  # seconds
FAULT_KINDS = ("kill", "stop", "terminate", "restart")
ACTION_KINDS = ("redrive", "skip")


@dataclass(frozen=True)
class Fault:
    """``kill``: SIGKILL relay ``relay``, started again ``lasts`` s later. ``stop``: SIGSTOP it
    for ``lasts`` s. ``terminate``: end its database sessions (pg_terminate_backend).
    ``restart``: restart PostgreSQL (``relay`` is -1)."""

    at: float
    kind: str
    relay: int
    lasts: float = 0.0


@dataclass(frozen=True)
class Freeze:
    """The sink answers nothing sent in [at, at + lasts) before at + lasts."""

    at: float
    lasts: float


@dataclass(frozen=True)
class SlowKeys:
    """Sends of the first ``keys`` keys in [at, at + lasts) are answered in 0.3-0.9 x the
    delivery timeout (a slow partition, a tenant's slow endpoint); other keys as usual."""

    at: float
    lasts: float
    keys: int


@dataclass(frozen=True)
class Action:
    """The operator redrives every dead letter, or skips every parked one, at ``at``."""

    at: float
    kind: str


@dataclass(frozen=True)
class Schedule:
    seed: int
    # The relays.
    relays: int
    ordering: str  # key | none
    on_dead: str  # park | continue
    capture: str  # table | wal
    batch_size: int
    in_flight: int
    lease: float
    delivery_timeout: float
    ownership_lease: float
    retry_base: float
    retry_cap: float
    max_attempts: int
    # The writer.
    events: int
    keys: int
    skew: float  # Zipf exponent of the keys' popularity (0: uniform)
    txn_size: int  # events per transaction, at most
    rollback: float  # share of transactions rolled back
    write_for: float  # seconds
    # The sink.
    sink_order: str  # chained: concurrent sends (the relay chains a key's); ordered: a key's queue
    latency_ms: float  # median answer time
    spread: float  # its lognormal sigma
    slow: float  # share of sends answered in 0.3-1.6 x the delivery timeout
    fail: float  # share of sends answered with a transient failure
    refuse: float  # share of sends refused (dead letters) until the last redrive
    late: float  # share of timed-out sends the receiver gets anyway, after the relay gave up
    concurrency: int = 0  # sends in progress at once, at most (0: no limit); the rest queue
    # Outboxes the relays serve beside the one checked, written in the same transactions (so due
    # at the same steps: their batches share transactions with its own), their events delivered
    # at once by the sink; each checked for every event archived once.
    twins: int = 0
    # The sink signals its reports (as Kafka's and the asyncio sinks do: the relay waits on its
    # wake-up with the rest of its news), or only answers when polled (a user's own sink).
    signals: bool = False
    slow_keys: tuple[SlowKeys, ...] = ()
    freezes: tuple[Freeze, ...] = ()
    faults: tuple[Fault, ...] = ()
    actions: tuple[Action, ...] = ()
    notes: tuple[str, ...] = field(default=(), compare=False)  # what shrinking took away

    @property
    def refuse_until(self) -> float:
        """Refusals stop at the last redrive (the receiver was fixed), else mid-write."""
        redrives = [a.at for a in self.actions if a.kind == "redrive"]
        return max(redrives) if redrives else self.write_for / 2

    @property
    def ends(self) -> float:
        """When the last fault, freeze or action is over."""
        times = [self.write_for]
        times += [f.at + f.lasts for f in self.faults]
        times += [f.at + f.lasts for f in self.freezes]
        times += [w.at + w.lasts for w in self.slow_keys]
        times += [a.at for a in self.actions]
        return max(times)

    def serial_seconds(self) -> float:
        """About how long the busiest key's events take to send, one after another: each send, and
        each failed one again after a poll (its expected retries: fail + fail² + ... up to
        max_attempts; seed 310, a single key failing one send in four, was still moving 180 s
        past its end where the sends alone were 11 s)."""
        weights = [1.0 / (k + 1) ** self.skew for k in range(self.keys)]
        busiest = self.events * weights[0] / sum(weights)
        typical = self.latency_ms / 1000 * math.exp(self.spread**2 / 2)
        each = (1 - self.slow) * typical + self.slow * self.delivery_timeout
        retries = sum(self.fail**attempt for attempt in range(1, self.max_attempts))
        return float(busiest * (each + retries * (POLL_INTERVAL + typical)))

    def render(self) -> str:
        """The schedule as text: the same seed, the same text."""
        lines = [
            f"schedule {self.seed}",
            f"  relays      {self.relays} process{'es' if self.relays > 1 else ''}, "
            f"ordering={self.ordering}, "
            f"on-dead={self.on_dead}, capture={self.capture}"
            + (f", {self.twins} twin outbox{'es' if self.twins > 1 else ''}" if self.twins else ""),
            f"  batches     size {self.batch_size}, {self.in_flight} in flight, lease {self.lease:g} s, "
            f"delivery timeout {self.delivery_timeout:g} s, ownership lease {self.ownership_lease:g} s",
            f"  retries     base {self.retry_base:g} s, cap {self.retry_cap:g} s, "
            f"{self.max_attempts} attempts",
            f"  writer      {self.events} events over {self.write_for:g} s, {self.keys} keys "
            f"(skew {self.skew:g}), up to {self.txn_size} a transaction, {self.rollback:.0%} rolled back",
            f"  sink        {self.sink_order}, {'signals' if self.signals else 'polled'}, "
            f"{self.concurrency or 'unlimited'} at a time, "
            f"latency {self.latency_ms:g} ms (sigma {self.spread:g}), "
            f"slow {self.slow:.0%}, failing {self.fail:.0%}, refusing {self.refuse:.0%} until "
            f"{self.refuse_until:g} s, late acks {self.late:.0%}",
        ]
        timeline = [(z.at, f"sink frozen for {z.lasts:g} s") for z in self.freezes]
        for w in self.slow_keys:
            timeline.append(
                (w.at, f"sink slow for {w.keys} key{'s' if w.keys > 1 else ''} for {w.lasts:g} s")
            )
        for f in self.faults:
            timeline.append((f.at, {
                "kill": f"SIGKILL relay {f.relay}, back {f.lasts:g} s later",
                "stop": f"SIGSTOP relay {f.relay} for {f.lasts:g} s",
                "terminate": f"terminate relay {f.relay}'s sessions",
                "restart": "restart PostgreSQL",
            }[f.kind]))  # fmt: skip
        for a in self.actions:
            chosen = "every dead letter" if a.kind == "redrive" else "every parked key"
            timeline.append((a.at, f"operator: {a.kind} {chosen}"))
        lines += [f"  {at:6.2f} s  {what}" for at, what in sorted(timeline, key=lambda item: item[0])]
        lines += [f"  ({note})" for note in self.notes]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        raw: dict[str, Any] = json.loads(text)
        raw["freezes"] = tuple(Freeze(**z) for z in raw["freezes"])
        raw["faults"] = tuple(Fault(**f) for f in raw["faults"])
        raw["actions"] = tuple(Action(**a) for a in raw["actions"])
        raw["slow_keys"] = tuple(SlowKeys(**w) for w in raw.get("slow_keys", ()))
        raw["notes"] = tuple(raw.get("notes", ()))
        return cls(**raw)

    def without(self, **changes: Any) -> Schedule:
        return replace(self, **changes)


def _r(x: float) -> float:
    """Two decimals: the printed schedule is the schedule."""
    return round(x, 2)


def draw(seed: int) -> Schedule:
    """The schedule of ``seed``."""
    rng = random.Random(seed)
    relays = rng.choice((1, 1, 2, 2, 3))
    lease = _r(rng.uniform(2.5, 6.0))
    delivery_timeout = _r(rng.uniform(0.4, 0.6) * lease)
    write_for = _r(rng.uniform(3.0, 7.0))
    faults: list[Fault] = []
    for _ in range(rng.choice((0, 0, 1, 1, 2, 3))):
        kind = rng.choice(FAULT_KINDS)
        at = _r(rng.uniform(0.5, write_for + 1.0))
        relay = rng.randrange(relays)
        if kind == "kill":
            faults.append(Fault(at, kind, relay, _r(rng.uniform(0.2, 2.0))))
        elif kind == "stop":  # shorter or longer than the lease
            faults.append(Fault(at, kind, relay, _r(rng.choice((0.3, 1.3)) * lease)))
        elif kind == "terminate":
            faults.append(Fault(at, kind, relay))
        else:
            faults.append(Fault(at, kind, -1))
    freezes: list[Freeze] = []
    for _ in range(rng.choice((0, 0, 1, 2))):
        # shorter than the delivery timeout, between it and the lease, or past the lease
        lasts = _r(rng.choice((0.5 * delivery_timeout, 0.5 * (delivery_timeout + lease), 1.2 * lease)))
        freezes.append(Freeze(_r(rng.uniform(0.3, write_for)), lasts))
    actions: list[Action] = []
    for _ in range(rng.choice((0, 1, 1, 2))):
        actions.append(Action(_r(rng.uniform(1.0, write_for + 3.0)), rng.choice(ACTION_KINDS)))
    schedule = Schedule(
        seed=seed,
        relays=relays,
        ordering=rng.choice(("key", "key", "key", "none")),
        on_dead=rng.choice(("park", "park", "continue")),
        capture=rng.choice(("table", "table", "table", "wal")),
        batch_size=rng.choice((5, 10, 20, 50, 100)),
        in_flight=rng.choice((1, 2, 2, 3, 4)),
        lease=lease,
        delivery_timeout=delivery_timeout,
        ownership_lease=_r(rng.uniform(1.5, 3.0)),
        retry_base=_r(rng.choice((0.05, 0.1, 0.2, 0.5))),
        retry_cap=_r(rng.choice((0.5, 1.0, 2.0))),
        max_attempts=rng.choice((3, 5, 8, 12)),
        events=rng.choice((50, 100, 200, 400, 800)),
        keys=rng.choice((1, 3, 5, 10, 30)),
        skew=rng.choice((0.0, 1.0, 1.5)),
        txn_size=rng.choice((1, 3, 10)),
        rollback=rng.choice((0.0, 0.05, 0.2)),
        write_for=write_for,
        sink_order=rng.choice(("chained", "chained", "ordered")),
        latency_ms=rng.choice((1.0, 5.0, 20.0, 100.0)),
        spread=rng.choice((0.2, 0.8, 1.5)),
        slow=rng.choice((0.0, 0.0, 0.02, 0.1)),
        fail=rng.choice((0.0, 0.02, 0.1, 0.25)),
        refuse=rng.choice((0.0, 0.0, 0.01, 0.05)),
        late=rng.choice((0.0, 0.5, 1.0)),
        concurrency=rng.choice((0, 2, 8, 32)),
        freezes=tuple(sorted(freezes, key=lambda z: z.at)),
        faults=tuple(sorted(faults, key=lambda f: f.at)),
        actions=tuple(sorted(actions, key=lambda a: a.at)),
    )
    slow_keys = [
        SlowKeys(
            _r(rng.uniform(0.2, write_for)),
            _r(rng.uniform(0.5, 2.0) * lease),
            rng.randint(1, max(1, schedule.keys // 3)),
        )
        for _ in range(rng.choice((0, 1, 1, 2)))
    ]
    schedule = replace(schedule, slow_keys=tuple(sorted(slow_keys, key=lambda w: w.at)))
    # Drawn apart, last: every seed's other draws are what they were before twins existed.
    schedule = replace(schedule, twins=random.Random(f"{seed}/twins").choice((0, 1, 2, 2)))
    schedule = replace(schedule, signals=random.Random(f"{seed}/signals").random() < 0.5)
    # A key's events go one at a time: fewer events, until the busiest key's would be sent in
    # SERIAL_BUDGET seconds (else no run drains, and every schedule fails the same way).
    while schedule.events > 50 and schedule.serial_seconds() > SERIAL_BUDGET:
        schedule = replace(schedule, events=schedule.events // 2)
    return schedule
