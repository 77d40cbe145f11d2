"""The ``outbox`` command line.

Every option can also be set through an ``OUTBOX_*`` environment variable
(shown in ``--help``); the DSN falls back to libpq's ``PG*`` variables when
neither ``--dsn`` nor ``OUTBOX_DSN`` is set.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, NoReturn

import psycopg

from outbox import migrate as migrations
from outbox import status as status_mod
from outbox.dsn import redact, scrub, secrets_in_argv, secrets_of
from outbox.hygiene import DEAD_TUPLES_THRESHOLD
from outbox.ownership import OWNERSHIP_LEASE
from outbox.relay import (
    BATCH_SIZE,
    DELIVERY_TIMEOUT,
    GRACE,
    LEASE,
    MAX_BATCHES_IN_FLIGHT,
    POLL_INTERVAL,
    Relay,
    RelayConfig,
)
from outbox.retry import RetryPolicy
from outbox.schema import DEFAULT_SCHEMA, validate_schema
from outbox.sinks.base import Sink
from outbox.sinks.kafka import KafkaSink

log = logging.getLogger("outbox")


class CliError(Exception):
    """An error the user can fix; printed without a traceback."""


def _env(name: str, default: Any = None) -> Any:
    return os.environ.get(name, default)


def _env_bool(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value.lower() in {"1", "true", "yes", "on"}:
        return True
    if value.lower() in {"0", "false", "no", "off"}:
        return False
    raise CliError(f"{name}: expected true/false, got {value!r}")


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return float(value)
    except ValueError:
        raise CliError(f"{name}: expected a number, got {value!r}") from None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise CliError(f"{name}: expected an integer, got {value!r}") from None


def parse_kafka_config(items: Sequence[str]) -> dict[str, str]:
    """``KEY=VALUE`` strings (or comma-separated lists of them) as a dict."""
    config: dict[str, str] = {}
    for item in items:
        for part in item.split(","):
            part = part.strip()
            if not part:
                continue
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise CliError(f"--kafka-config: expected KEY=VALUE, got {part.split('=')[0]!r}")
            config[key.strip()] = value.strip()
    return config


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def _setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dsn",
        default=_env("OUTBOX_DSN", ""),
        help="PostgreSQL connection string [OUTBOX_DSN; else libpq's PG* variables]",
    )
    p.add_argument(
        "--schema",
        default=_env("OUTBOX_SCHEMA", DEFAULT_SCHEMA),
        help=f"schema of the outbox tables [OUTBOX_SCHEMA; default {DEFAULT_SCHEMA}]",
    )
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default=_env("OUTBOX_LOG_FORMAT", "text"),
        help="log line format [OUTBOX_LOG_FORMAT; default text]",
    )
    p.add_argument(
        "--log-level",
        default=_env("OUTBOX_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
        help="[OUTBOX_LOG_LEVEL; default info]",
    )


def _add_kafka(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--kafka-bootstrap",
        default=_env("OUTBOX_KAFKA_BOOTSTRAP"),
        help="Kafka bootstrap servers HOST:PORT[,...] [OUTBOX_KAFKA_BOOTSTRAP]",
    )
    p.add_argument(
        "--kafka-config",
        action="append",
        default=[c for c in [_env("OUTBOX_KAFKA_CONFIG")] if c],
        metavar="KEY=VALUE",
        help="librdkafka producer setting, repeatable, e.g. security.protocol=SASL_SSL "
        "[OUTBOX_KAFKA_CONFIG: comma-separated KEY=VALUE list]",
    )


def _add_relay_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--batch-size",
        type=int,
        default=_env_int("OUTBOX_BATCH_SIZE", BATCH_SIZE),
        help=f"events per claim [OUTBOX_BATCH_SIZE; default {BATCH_SIZE}]",
    )
    p.add_argument(
        "--batches-in-flight",
        type=int,
        default=_env_int("OUTBOX_BATCHES_IN_FLIGHT", MAX_BATCHES_IN_FLIGHT),
        help="claimed batches awaiting acks at once "
        f"[OUTBOX_BATCHES_IN_FLIGHT; default {MAX_BATCHES_IN_FLIGHT}]",
    )
    p.add_argument(
        "--lease",
        type=float,
        default=_env_float("OUTBOX_LEASE", LEASE),
        help=f"seconds before a stalled worker loses its batch [OUTBOX_LEASE; default {LEASE}]",
    )
    p.add_argument(
        "--delivery-timeout",
        type=float,
        default=_env_float("OUTBOX_DELIVERY_TIMEOUT", DELIVERY_TIMEOUT),
        help=f"seconds the broker may take to ack [OUTBOX_DELIVERY_TIMEOUT; default {DELIVERY_TIMEOUT}]",
    )
    p.add_argument(
        "--poll-interval",
        type=float,
        default=_env_float("OUTBOX_POLL_INTERVAL", POLL_INTERVAL),
        help=f"seconds between polls when idle [OUTBOX_POLL_INTERVAL; default {POLL_INTERVAL}]",
    )
    p.add_argument(
        "--notify",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("OUTBOX_NOTIFY", True),
        help="wake on LISTEN/NOTIFY as well as polling [OUTBOX_NOTIFY; default on]",
    )
    p.add_argument(
        "--archive",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("OUTBOX_ARCHIVE", True),
        help="keep delivered events in the archive [OUTBOX_ARCHIVE; default on]",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=_env_float("OUTBOX_GRACE", GRACE),
        help=f"seconds to finish in-flight work on SIGTERM [OUTBOX_GRACE; default {GRACE}]",
    )
    p.add_argument(
        "--retry-base",
        type=float,
        default=_env_float("OUTBOX_RETRY_BASE", 1.0),
        help="seconds before the first retry [OUTBOX_RETRY_BASE; default 1]",
    )
    p.add_argument(
        "--retry-cap",
        type=float,
        default=_env_float("OUTBOX_RETRY_CAP", 300.0),
        help="longest wait between retries, seconds [OUTBOX_RETRY_CAP; default 300]",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=_env_int("OUTBOX_MAX_ATTEMPTS", 10),
        help="attempts before dead-lettering [OUTBOX_MAX_ATTEMPTS; default 10]",
    )
    p.add_argument(
        "--ordering",
        choices=["key", "none"],
        default=_env("OUTBOX_ORDERING", "key"),
        help="key: per-key order across relays; none: maximum parallelism [OUTBOX_ORDERING; default key]",
    )
    p.add_argument(
        "--on-dead",
        choices=["park", "continue"],
        default=_env("OUTBOX_ON_DEAD", "park"),
        help="park: a dead letter holds back its key's later events; continue: it does not "
        "[OUTBOX_ON_DEAD; default park]",
    )
    p.add_argument(
        "--ownership-lease",
        type=float,
        default=_env_float("OUTBOX_OWNERSHIP_LEASE", OWNERSHIP_LEASE),
        help="seconds before a silent relay's partitions are taken over "
        f"[OUTBOX_OWNERSHIP_LEASE; default {OWNERSHIP_LEASE:g}]",
    )
    p.add_argument(
        "--name",
        default=_env("OUTBOX_RELAY_NAME"),
        help="this relay's name in `outbox status` [OUTBOX_RELAY_NAME; default host:pid]",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=_env_int("OUTBOX_METRICS_PORT", 0) or None,
        help="serve /metrics, /livez, /readyz on this port [OUTBOX_METRICS_PORT; default: off]",
    )
    p.add_argument(
        "--metrics-host",
        default=_env("OUTBOX_METRICS_HOST", "127.0.0.1"),
        help="address to bind the metrics/health port [OUTBOX_METRICS_HOST; default 127.0.0.1]",
    )
    p.add_argument(
        "--vacuum",
        action=argparse.BooleanOptionalAction,
        default=_env_bool("OUTBOX_VACUUM", True),
        help="vacuum the hot table from the relay when dead tuples pile up, even with autovacuum "
        "off [OUTBOX_VACUUM; default on]",
    )
    p.add_argument(
        "--vacuum-threshold",
        type=int,
        default=_env_int("OUTBOX_VACUUM_THRESHOLD", DEAD_TUPLES_THRESHOLD),
        help=f"dead tuples that trigger it [OUTBOX_VACUUM_THRESHOLD; default {DEAD_TUPLES_THRESHOLD}]",
    )
    p.add_argument(
        "--sink",
        default=_env("OUTBOX_SINK", "kafka"),
        help="kafka, or MODULE:FACTORY for a custom sink, called as "
        "factory(bootstrap, kafka_config, delivery_timeout) [OUTBOX_SINK; default kafka]",
    )


_parsing: list[str] = []  # the arguments main() is parsing (they may not be sys.argv)


class _Parser(argparse.ArgumentParser):
    """argparse echoes arguments in its errors ("unrecognized arguments: ..."):
    scrub any password in them first. Sub-parsers inherit this class."""

    def error(self, message: str) -> NoReturn:
        super().error(scrub(message, secrets_in_argv([*sys.argv[1:], *_parsing])))


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="outbox",
        description="Transactional outbox relay: PostgreSQL outbox table -> Kafka. "
        "Every option can also be set with the OUTBOX_* variable named in its help.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("migrate", help="create or upgrade the outbox tables")
    _add_common(p)
    p.add_argument("--print", action="store_true", help="print the SQL instead of applying it")
    p.add_argument(
        "--roles",
        action="store_true",
        default=_env_bool("OUTBOX_ROLES", False),
        help="also create (if missing) and grant a writer role that can only insert events and a relay "
        "role with exactly what the relay needs [OUTBOX_ROLES; default off]",
    )
    p.add_argument(
        "--writer-role",
        default=_env("OUTBOX_WRITER_ROLE", None),
        help="name of the writer role; implies --roles "
        f"[OUTBOX_WRITER_ROLE; default {migrations.DEFAULT_WRITER_ROLE}]",
    )
    p.add_argument(
        "--relay-role",
        default=_env("OUTBOX_RELAY_ROLE", None),
        help="name of the relay role; implies --roles "
        f"[OUTBOX_RELAY_ROLE; default {migrations.DEFAULT_RELAY_ROLE}]",
    )
    p.add_argument(
        "--no-create-roles",
        action="store_true",
        help="grant to roles that already exist (for example your login roles) instead of creating them",
    )

    p = sub.add_parser("relay", help="publish committed events until SIGTERM/SIGINT")
    _add_common(p)
    _add_kafka(p)
    _add_relay_options(p)

    p = sub.add_parser("status", help="depth, age, errors and dead letters")
    _add_common(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("dead", help="list, redrive or skip dead letters (parked keys)")
    dead = p.add_subparsers(dest="dead_command", required=True)
    d = dead.add_parser("list", help="dead letters with the events parked behind them")
    _add_common(d)
    d.add_argument("--topic")
    d.add_argument("--key", help="the event key (UTF-8 text, or 0x... for bytes)")
    d.add_argument("--limit", type=int, default=100)
    d.add_argument("--json", action="store_true")
    for verb, text in (
        ("redrive", "put dead letters back at the head of their key; parked events follow in order"),
        ("skip", "give dead letters up and release the events parked behind them"),
    ):
        d = dead.add_parser(verb, help=text)
        _add_common(d)
        d.add_argument("ids", nargs="*", type=int, metavar="ID")
        d.add_argument("--key", help="every dead letter of this key")
        if verb == "redrive":
            d.add_argument("--all", action="store_true", help="every dead letter")
        d.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")

    p = sub.add_parser("retry", help="put dead letters back into the outbox (all, or filtered)")
    _add_common(p)
    p.add_argument("--topic", help="only dead letters of this topic")
    p.add_argument(
        "--error-like", help="only those whose error matches this SQL LIKE pattern, e.g. '%%timed out%%'"
    )
    p.add_argument("--ids", nargs="+", type=int, metavar="ID", help="only these dead letters")
    p.add_argument("--dry-run", action="store_true", help="say what would change, change nothing")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    p = sub.add_parser("replay", help="re-send archived events delivered in a time window")
    _add_common(p)
    p.add_argument("--since", required=True, help="ISO time (UTC if no zone) or a duration ago, e.g. 2h")
    p.add_argument("--until", default=None, help="ISO time or a duration ago [default: now]")
    p.add_argument("--topic")
    p.add_argument("--key", help="the event key (UTF-8 text, or 0x... for bytes)")
    p.add_argument("--dry-run", action="store_true", help="count what would be re-sent, send nothing")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    p = sub.add_parser("purge", help="drop archive partitions older than a duration")
    _add_common(p)
    p.add_argument("--older-than", required=True, help="a duration, e.g. 30d, 12h")
    p.add_argument("--dry-run", action="store_true", help="list what would be dropped, drop nothing")
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")

    p = sub.add_parser("notify", help="switch the NOTIFY trigger on or off")
    _add_common(p)
    p.add_argument("state", choices=["on", "off"])

    p = sub.add_parser("demo", help="the whole pipeline on this machine, with live progress")
    _add_common(p)
    _add_kafka(p)
    p.add_argument(
        "--seconds",
        type=float,
        default=_env_float("OUTBOX_DEMO_SECONDS", 0.0),
        help="stop after this many seconds (0: until Ctrl-C) [OUTBOX_DEMO_SECONDS]",
    )
    p.add_argument(
        "--rate",
        type=float,
        default=_env_float("OUTBOX_DEMO_RATE", 500.0),
        help="orders per second written by the sample app [OUTBOX_DEMO_RATE; default 500]",
    )
    p = sub.add_parser(
        "bench",
        help="benchmark the relay against baselines (tables and plots), or run the fault suite",
        description="outbox bench [perf]: speed against the baselines. outbox bench faults: kill, restart, "
        "stall and poison things under load, then count what was lost (exit 1 unless every scenario passes).",
    )
    p.add_argument("suite", nargs="?", choices=["perf", "faults"], default="perf", help="[default perf]")
    p.add_argument(
        "--dsn",
        default=_env("OUTBOX_DSN"),
        help="PostgreSQL to use [OUTBOX_DSN; default: an embedded one]",
    )
    _add_kafka(p)
    p.add_argument(
        "--scenarios",
        default=None,
        help="comma-separated. perf: drain, steady, writer, soak, scale [all]. faults: kill, pg-restart, "
        "terminate, broker, slow-sink, snapshot, poison, sigstop, soak [all]",
    )
    p.add_argument("--out", default=None, help="output directory [default bench-results or fault-results]")
    p.add_argument(
        "--smoke",
        "--short",
        dest="smoke",
        action="store_true",
        help="seconds per scenario instead of minutes: checks that everything runs "
        "(faults: and loses nothing)",
    )
    p.add_argument("--rate", type=int, help="faults: business transactions per second [1000; --short 300]")
    p.add_argument(
        "--pg-restart-command",
        default=_env("OUTBOX_PG_RESTART_COMMAND"),
        help="faults with --dsn: command that restarts that PostgreSQL [OUTBOX_PG_RESTART_COMMAND]",
    )
    p.add_argument(
        "--broker-stop-command", help="faults with --kafka-bootstrap: command that stops the broker"
    )
    p.add_argument(
        "--broker-start-command", help="faults with --kafka-bootstrap: command that starts it again"
    )
    p.add_argument("--events", type=int, help="drain/scale: pending events [500000]")
    p.add_argument("--repeat", type=int, help="drain: runs per contender [3]")
    p.add_argument("--rates", help="steady: comma-separated events/s [1000,5000,20000]")
    p.add_argument("--steady-seconds", type=float, help="steady: seconds per rate [30]")
    p.add_argument("--soak-minutes", type=float, help="soak: minutes [10]")
    p.add_argument("--soak-rate", type=int, help="soak: events/s [2000]")
    p.add_argument("--snapshot-seconds", type=float, help="soak: snapshot held open [60]")
    p.add_argument("--scale-processes", help="scale: comma-separated process counts [1,2,4]")
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    return parser


def _connect(dsn: str, secrets: list[str]) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(dsn, application_name="outbox-cli")
    except psycopg.OperationalError as exc:
        raise CliError(f"cannot connect to PostgreSQL ({redact(dsn)}): {scrub(str(exc), secrets)}") from None


def _role_error(exc: ValueError) -> CliError:
    """'writer role: …' from the library as the option it came from: '--writer-role: …'."""
    return CliError("--" + str(exc).replace(" role: ", "-role: ", 1))


def _roles(args: argparse.Namespace) -> migrations.Roles | None:
    if not (args.roles or args.writer_role or args.relay_role or args.no_create_roles):
        return None
    try:
        return migrations.Roles(
            writer=migrations.DEFAULT_WRITER_ROLE if args.writer_role is None else args.writer_role,
            relay=migrations.DEFAULT_RELAY_ROLE if args.relay_role is None else args.relay_role,
            create=not args.no_create_roles,
        )
    except ValueError as exc:
        raise _role_error(exc) from None


def cmd_migrate(args: argparse.Namespace) -> int:
    validate_schema(args.schema, "--schema")
    roles = _roles(args)
    if args.print:
        sys.stdout.write(migrations.render_all(args.schema, roles))
        return 0
    with _connect(args.dsn, secrets_of(args.dsn)) as conn:
        applied = migrations.migrate(conn, args.schema)
        if roles is not None:
            try:
                migrations.grant_roles(conn, args.schema, roles)
            except ValueError as exc:
                raise _role_error(exc) from None
            print(f"granted schema {args.schema} to writer role {roles.writer} and relay role {roles.relay}")
    if applied:
        for m in applied:
            print(f"applied {m.version:04d}_{m.name} to schema {args.schema}")
    else:
        print(f"schema {args.schema} is up to date")
    return 0


def relay_config(args: argparse.Namespace) -> RelayConfig:
    return RelayConfig(
        dsn=args.dsn,
        schema=validate_schema(args.schema, "--schema"),
        batch_size=args.batch_size,
        max_batches_in_flight=args.batches_in_flight,
        lease=args.lease,
        delivery_timeout=args.delivery_timeout,
        poll_interval=args.poll_interval,
        notify=args.notify,
        archive=args.archive,
        grace=args.grace,
        retry=RetryPolicy(base=args.retry_base, cap=args.retry_cap, max_attempts=args.max_attempts),
        ordering=args.ordering,
        on_dead=args.on_dead,
        ownership_lease=args.ownership_lease,
        vacuum=args.vacuum,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        vacuum_threshold=args.vacuum_threshold,
        **({"name": args.name} if args.name else {}),
    )


def load_sink_factory(spec: str) -> Any:
    """``kafka`` or ``module:callable`` -> a factory(bootstrap, kafka_config, delivery_timeout)."""
    if spec == "kafka":
        return lambda bootstrap, config, timeout: KafkaSink(bootstrap, config, delivery_timeout=timeout)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"--sink: expected 'kafka' or MODULE:FACTORY, got {spec!r}")
    import importlib

    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise CliError(f"--sink: cannot load {spec!r}: {exc}") from None
    if not callable(factory):
        raise CliError(f"--sink: {spec!r} is not callable")
    return factory


def run_until_signal(relay: Relay) -> None:
    """Run ``relay`` in a thread; SIGTERM/SIGINT ask it to stop gracefully.

    Raises CliError if the relay stopped because it failed (not because it was asked).
    """
    failure: list[BaseException] = []

    def target() -> None:
        try:
            relay.run()
        except Exception as exc:  # logged by the relay; turned into a non-zero exit below
            failure.append(exc)

    thread = threading.Thread(target=target, name="outbox-relay")

    def on_signal(signum: int, _frame: Any) -> None:
        log.info("received %s: stopping", signal.Signals(signum).name)
        relay.stop()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failure:
        raise CliError(f"the relay failed: {failure[0]}")


def _require_migrated(conn: psycopg.Connection[Any], schema: str) -> None:
    """Refuse to run against a schema that lacks any migration this version ships."""
    applied = migrations.applied_versions(conn, schema)
    if not applied:
        raise CliError(f"--schema: {schema!r} is not migrated; run `outbox migrate`")
    missing = [f"{m.version:04d}_{m.name}" for m in migrations.migrations() if m.version not in applied]
    if missing:
        raise CliError(
            f"--schema: {schema!r} lacks migrations {', '.join(missing)}; run `outbox migrate` "
            "before starting this version"
        )


def cmd_relay(args: argparse.Namespace) -> int:
    if not args.kafka_bootstrap:
        raise CliError("--kafka-bootstrap (or OUTBOX_KAFKA_BOOTSTRAP) is required")
    config = relay_config(args)
    from outbox.tracing import configure_from_env

    if configure_from_env():
        log.info("tracing on (OTEL_* environment)")
    kafka_config = parse_kafka_config(args.kafka_config)
    # Fail fast on a bad DSN or an unmigrated schema, before starting anything.
    with _connect(args.dsn, secrets_of(args.dsn)) as conn:
        _require_migrated(conn, config.schema)

    factory = load_sink_factory(args.sink)

    def sink() -> Sink:
        built: Sink = factory(args.kafka_bootstrap, kafka_config, config.delivery_timeout)
        return built

    sink().close(0)  # validates the sink's configuration now, with a clear error
    run_until_signal(Relay(config, sink))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    validate_schema(args.schema, "--schema")
    with _connect(args.dsn, secrets_of(args.dsn)) as conn:
        _require_migrated(conn, args.schema)
        report = status_mod.collect(conn, args.schema)
    if args.json:
        print(json.dumps(report))
    else:
        print(status_mod.render(report))
    return 0


def cmd_notify(args: argparse.Namespace) -> int:
    from psycopg import sql

    validate_schema(args.schema, "--schema")
    verb = sql.SQL("ENABLE" if args.state == "on" else "DISABLE")
    with _connect(args.dsn, secrets_of(args.dsn)) as conn:
        conn.execute(
            sql.SQL("ALTER TABLE {}.events {} TRIGGER events_notify").format(
                sql.Identifier(args.schema), verb
            )
        )
    print(f"NOTIFY on insert is {args.state} for schema {args.schema}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from outbox.demo import run_demo

    return run_demo(
        dsn=args.dsn or None,
        bootstrap=args.kafka_bootstrap,
        schema=validate_schema(args.schema, "--schema"),
        seconds=args.seconds,
        rate=args.rate,
        kafka_config=parse_kafka_config(args.kafka_config),
    )


def _int_list(text: str, field: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"{field}: expected comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise CliError(f"{field}: expected positive integers, got {text!r}")
    return values


def cmd_faults(args: argparse.Namespace) -> int:
    from pathlib import Path

    from outbox.bench.faults import SCENARIOS, run_faults

    if args.rate is not None and args.rate <= 0:
        raise CliError(f"--rate: must be > 0, got {args.rate}")
    chosen = [s.strip() for s in (args.scenarios or ",".join(SCENARIOS)).split(",") if s.strip()]
    try:
        results = run_faults(
            dsn=args.dsn or None,
            bootstrap=args.kafka_bootstrap,
            chosen=chosen,
            out=Path(args.out or "fault-results"),
            short=args.smoke,
            rate=args.rate,
            pg_restart_command=args.pg_restart_command,
            broker_stop_command=args.broker_stop_command,
            broker_start_command=args.broker_start_command,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from None
    failed = [name for name, r in results["scenarios"].items() if not r["passed"]]
    if failed:
        raise CliError(
            f"fault scenarios failed: {', '.join(failed)} (details in results.json and the relay logs)"
        )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from outbox.bench import run_bench

    if args.suite == "faults":
        return cmd_faults(args)

    overrides: dict[str, Any] = {}
    for name in (
        "events",
        "repeat",
        "steady_seconds",
        "soak_minutes",
        "soak_rate",
        "snapshot_seconds",
    ):
        value = getattr(args, name)
        if value is not None:
            if value <= 0:
                raise CliError(f"--{name.replace('_', '-')}: must be > 0, got {value}")
            overrides[name] = value
    if args.rates:
        overrides["rates"] = _int_list(args.rates, "--rates")
    if args.scale_processes:
        overrides["scale_processes"] = _int_list(args.scale_processes, "--scale-processes")
    run_bench(
        dsn=args.dsn or None,
        bootstrap=args.kafka_bootstrap,
        chosen=[
            s.strip() for s in (args.scenarios or "drain,steady,writer,soak,scale").split(",") if s.strip()
        ],
        out=Path(args.out or "bench-results"),
        smoke=args.smoke,
        overrides=overrides,
    )
    return 0


def _key_arg(key: str | None) -> bytes | None:
    if key is None:
        return None
    if key.startswith("0x"):
        try:
            return bytes.fromhex(key[2:])
        except ValueError:
            raise CliError(f"--key: {key!r} is not valid hex after 0x") from None
    return key.encode("utf-8")


def cmd_dead(args: argparse.Namespace) -> int:
    from outbox import dead as dead_mod

    validate_schema(args.schema, "--schema")
    with _connect(args.dsn, secrets_of(args.dsn)) as conn:
        if args.dead_command == "list":
            rows = dead_mod.list_dead(
                conn, args.schema, topic=args.topic, key=_key_arg(args.key), limit=args.limit
            )
            if args.json:
                print(json.dumps(rows))
            else:
                print(dead_mod.render(rows))
            return 0
        select_all = bool(getattr(args, "all", False))
        if not args.ids and args.key is None and not select_all:
            raise CliError(
                f"dead {args.dead_command}: give dead letter IDs, --key K"
                + (" or --all" if args.dead_command == "redrive" else "")
            )
        ids = dead_mod.select(conn, args.schema, ids=args.ids, key=_key_arg(args.key), all_=select_all)
        if not ids:
            print("no dead letter matches")
            return 1
        if args.dry_run:
            print(
                f"would {args.dead_command} {len(ids)} dead letters: {ids[:20]}"
                + (" ..." if len(ids) > 20 else "")
            )
            conn.rollback()
            return 0
        if args.dead_command == "redrive":
            n = dead_mod.redrive(conn, args.schema, ids)
            print(f"redrove {n} dead letters; they are delivered first, then the events parked behind them")
        else:
            n = dead_mod.skip(conn, args.schema, ids)
            print(f"skipped {n} dead letters; the events parked behind them are released")
        conn.commit()
    return 0


def _confirm(args: argparse.Namespace, question: str) -> None:
    """Ask before a destructive change, unless --yes; refuse when there is nobody to ask."""
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise CliError(f"{question}: pass --yes to confirm (there is no terminal to ask)")
    answer = input(f"{question} [y/N] ").strip().lower()
    if answer not in ("y", "yes"):
        raise CliError("cancelled")


def cmd_retry(args: argparse.Namespace) -> int:
    from outbox import admin, dead

    validate_schema(args.schema, "--schema")
    with _connect(args.dsn, secrets_of(args.dsn)) as conn:
        ids = admin.retry_select(
            conn, args.schema, topic=args.topic, error_like=args.error_like, ids=args.ids
        )
        if not ids:
            print("no dead letter matches")
            return 1
        if args.dry_run:
            print(f"would retry {len(ids)} dead letters: {ids[:20]}" + (" ..." if len(ids) > 20 else ""))
            return 0
        _confirm(args, f"retry {len(ids)} dead letters")
        n = dead.redrive(conn, args.schema, ids)
        conn.commit()
    print(f"retrying {n} dead letters (back at the head of their keys, attempts reset)")
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    import datetime as dt

    from outbox import admin
    from outbox.progress import Progress

    validate_schema(args.schema, "--schema")
    now = dt.datetime.now(dt.timezone.utc)
    since = admin.parse_time(args.since, "--since", now)
    until = admin.parse_time(args.until, "--until", now) if args.until else now
    if until <= since:
        raise CliError(f"--until: must be after --since ({since.isoformat()})")
    key = _key_arg(args.key)
    with _connect(args.dsn, secrets_of(args.dsn)) as conn:
        n = admin.replay_count(conn, args.schema, since=since, until=until, topic=args.topic, key=key)
        window = f"{since.isoformat(timespec='seconds')} .. {until.isoformat(timespec='seconds')}"
        if args.dry_run or not n:
            print(f"would replay {n} archived events delivered {window}")
            return 0
        _confirm(args, f"replay {n} archived events delivered {window}")
        progress = Progress("replay", n, " ev")
        done = admin.replay(
            conn, args.schema, since=since, until=until, topic=args.topic, key=key, progress=progress.update
        )
        progress.close()
    print(f"queued {done} events again, with new event-ids and header outbox-replay-of")
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    import datetime as dt

    from outbox import admin
    from outbox.progress import Progress

    validate_schema(args.schema, "--schema")
    cutoff = dt.datetime.now(dt.timezone.utc) - admin.parse_duration(args.older_than, "--older-than")
    with _connect(args.dsn, secrets_of(args.dsn)) as conn:
        parts = admin.purge_plan(conn, args.schema, cutoff)
        what = f"{len(parts)} archive partitions before {cutoff.date().isoformat()}"
        if args.dry_run:
            print(f"would drop {what}: {', '.join(parts) or '-'} (and older rows of delivered_default)")
            return 0
        _confirm(args, f"drop {what}")
        progress = Progress("purge", max(len(parts), 1), " partitions")
        deleted = admin.purge(conn, args.schema, cutoff, parts, progress=progress.update)
        progress.close()
    print(f"dropped {len(parts)} partitions; deleted {deleted} older rows from delivered_default")
    return 0


COMMANDS = {
    "migrate": cmd_migrate,
    "relay": cmd_relay,
    "status": cmd_status,
    "notify": cmd_notify,
    "dead": cmd_dead,
    "retry": cmd_retry,
    "replay": cmd_replay,
    "purge": cmd_purge,
    "demo": cmd_demo,
    "bench": cmd_bench,
}


def main(argv: Sequence[str] | None = None) -> int:
    try:
        _parsing[:] = list(argv) if argv is not None else []
        args = build_parser().parse_args(argv)
        _setup_logging(args.log_format, args.log_level)
        return COMMANDS[args.command](args)
    except (CliError, ValueError, TypeError) as exc:
        secrets = secrets_of(os.environ.get("OUTBOX_DSN", ""))
        print(f"outbox: error: {scrub(str(exc), secrets)}", file=sys.stderr)
        return 2
    except psycopg.Error as exc:
        secrets = secrets_of(os.environ.get("OUTBOX_DSN", ""))
        print(f"outbox: database error: {scrub(str(exc), secrets)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
