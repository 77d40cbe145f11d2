"""The relay's configuration: every tunable, its default with its unit, and its help.

This dataclass is the one source of the relay's options: ``outbox relay``
builds its flags and ``OUTBOX_*`` variables from these fields (see
``outbox.settings``), and the library takes the same object.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

from outbox.errors import ConfigError
from outbox.relay.limits import Limit, parse_limits, parse_weights
from outbox.relay.ordering import ON_DEAD, ORDERINGS, OWNERSHIP_LEASE
from outbox.relay.retry import RetryPolicy
from outbox.settings import setting
from outbox.store.hygiene import DEAD_TUPLES_THRESHOLD
from outbox.store.schema import DEFAULT_SCHEMA, validate_schema
from outbox.transform import Transforms, parse_transforms

BATCH_SIZE = 2000  # events per claim
MAX_BATCHES_IN_FLIGHT = 2  # claimed batches awaiting acks at once (one connection each)
LEASE = 30.0  # seconds a stalled worker keeps its batch before PostgreSQL ends its session
DELIVERY_TIMEOUT = 15.0  # seconds the sink may take to ack; must be well under LEASE
POLL_INTERVAL = 1.0  # seconds between polls when idle (jittered ±50%); NOTIFY wakes sooner
GRACE = 20.0  # seconds to finish in-flight batches at shutdown
NET_TIMEOUT = 10.0  # seconds before a silent connection counts as dead
STALL_TIMEOUT = 10.0  # seconds without progress before /readyz reports a stall
MAX_CONNECTIONS = 4  # sessions a relay opens per database for batches and maintenance


def _default_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass
class RelayConfig:
    dsn: str = setting(help="PostgreSQL connection string", cli=False)
    schema: str = setting(DEFAULT_SCHEMA, "schema of the outbox tables", cli=False)
    batch_size: int = setting(BATCH_SIZE, "events per claim")
    max_batches_in_flight: int = setting(
        MAX_BATCHES_IN_FLIGHT,
        "claimed batches awaiting acks at once",
        flag="--batches-in-flight",
        env="OUTBOX_BATCHES_IN_FLIGHT",
    )
    max_connections: int = setting(
        MAX_CONNECTIONS,
        "sessions per database for batches and maintenance, shared by its outboxes (besides one "
        "each for heartbeats, LISTEN, vacuum and metrics)",
    )
    lease: float = setting(LEASE, "seconds before a stalled worker loses its batch")
    delivery_timeout: float = setting(DELIVERY_TIMEOUT, "seconds the sink may take to acknowledge")
    poll_interval: float = setting(POLL_INTERVAL, "seconds between polls when idle")
    notify: bool = setting(True, "wake on LISTEN/NOTIFY as well as polling")
    archive: bool = setting(True, "keep delivered events in the archive")
    shared_claims: bool = setting(
        True, "claim several outboxes' short batches in one transaction (a relay serving many)"
    )
    shared_outboxes: int = setting(8, "outboxes whose claims share a transaction, at most (--shared-claims)")
    grace: float = setting(GRACE, "seconds to finish in-flight work on SIGTERM")
    retry: RetryPolicy = setting(default_factory=RetryPolicy, help="the retry schedule", cli=False)
    ordering: str = setting(
        "key", "key: per-key order across relays; none: maximum parallelism", choices=ORDERINGS
    )
    on_dead: str = setting(
        "park",
        "park: a dead letter holds back its key's later events; continue: it does not",
        choices=ON_DEAD,
    )
    ownership_lease: float = setting(
        OWNERSHIP_LEASE, "seconds before a silent relay's partitions are taken over"
    )
    name: str = setting(
        default_factory=_default_name,
        help="this relay's name in `outbox status`",
        env="OUTBOX_RELAY_NAME",
        default_text="host:pid",
    )
    vacuum: bool = setting(
        True, "vacuum the hot table from the relay when dead tuples pile up, even with autovacuum off"
    )
    vacuum_threshold: int = setting(DEAD_TUPLES_THRESHOLD, "dead tuples that trigger it")
    metrics_port: int | None = setting(
        None, "serve /metrics, /livez, /readyz on this port", default_text="off"
    )
    metrics_host: str = setting("127.0.0.1", "address to bind the metrics/health port")
    net_timeout: float = setting(
        NET_TIMEOUT,
        "seconds before a silent PostgreSQL connection counts as dead (keepalives, tcp_user_timeout; "
        "a DSN's own settings win) and the Kafka socket timeout",
    )
    stall_timeout: float = setting(
        STALL_TIMEOUT,
        "seconds without a completed claim or heartbeat, or with batches in flight and no delivery "
        "report, before /readyz says the relay is stalled",
    )

    limit: list[str] = setting(
        default_factory=list,
        help="GLOB=SPEC: events whose topic matches GLOB (as routes match; the first limit that "
        "matches wins) are sent at most at this rate and/or this many at once, per outbox, shared "
        "by every relay serving it: SPEC is N/s and/or in_flight=N, comma-separated, e.g. "
        "'partner.*=50/s,in_flight=8'; their backlog waits in the table; repeatable (in the "
        "variable: separated by whitespace)",
        env="OUTBOX_LIMITS",
        metavar="GLOB=SPEC",
    )
    weight: list[str] = setting(
        default_factory=list,
        help="GLOB=N: outboxes whose name matches GLOB get N shares of the relay's claims while "
        "several have a backlog (default 1; the first match wins); repeatable (in the variable: "
        "separated by whitespace)",
        env="OUTBOX_WEIGHTS",
        metavar="GLOB=N",
    )

    transform: list[str] = setting(
        default_factory=list,
        help="GLOB=module:function: events whose topic matches GLOB (as routes match; the first "
        "transform that matches wins) go through the function before routing: called with an "
        "outbox.Event, it returns the event (changed with dataclasses.replace: a new topic is "
        "routed anew, a new key is the key the sink gets) or None (dropped, archived as "
        "filtered); if it raises, the event is a dead letter of kind transform_failed; "
        "repeatable (in the variable: separated by whitespace)",
        env="OUTBOX_TRANSFORMS",
        metavar="GLOB=module:function",
    )

    @property
    def transforms(self) -> Transforms:
        """The ``--transform`` functions, imported."""
        return parse_transforms(self.transform)

    @property
    def limits(self) -> list[Limit]:
        return parse_limits(self.limit)

    @property
    def weights(self) -> list[tuple[str, int]]:
        return parse_weights(self.weight)

    def __post_init__(self) -> None:
        validate_schema(self.schema)
        self.limits  # noqa: B018  (refused at start, naming the option)
        self.weights  # noqa: B018
        self.transforms  # noqa: B018  (each function imported: refused at start, naming the option)
        if self.ordering not in ORDERINGS:
            raise ConfigError(f"ordering: must be one of {ORDERINGS}, got {self.ordering!r}")
        if self.on_dead not in ON_DEAD:
            raise ConfigError(f"on-dead: must be one of {ON_DEAD}, got {self.on_dead!r}")
        if not self.ownership_lease > 0:
            raise ConfigError(f"ownership lease: must be > 0 seconds, got {self.ownership_lease}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size: must be >= 1, got {self.batch_size}")
        if self.shared_outboxes < 1:
            raise ConfigError(f"shared outboxes: must be >= 1, got {self.shared_outboxes}")
        if self.max_connections < 1:
            raise ConfigError(f"max connections: must be >= 1, got {self.max_connections}")
        if self.max_batches_in_flight < 1:
            raise ConfigError(f"batches in flight: must be >= 1, got {self.max_batches_in_flight}")
        if not self.poll_interval > 0:
            raise ConfigError(f"poll interval: must be > 0 seconds, got {self.poll_interval}")
        if not self.net_timeout >= 2:
            raise ConfigError(f"net timeout: must be >= 2 seconds, got {self.net_timeout}")
        if not self.stall_timeout > 0:
            raise ConfigError(f"stall timeout: must be > 0 seconds, got {self.stall_timeout}")
        if self.grace < 0:
            raise ConfigError(f"grace: must be >= 0 seconds, got {self.grace}")
        # The sink must answer before PostgreSQL ends the batch's session.
        if not 0 < self.delivery_timeout < self.lease:
            raise ConfigError(
                f"delivery timeout: must be > 0 and shorter than the lease ({self.lease} s), "
                f"got {self.delivery_timeout}"
            )
