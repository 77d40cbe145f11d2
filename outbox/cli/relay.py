"""``outbox relay``: publish committed events until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.cli import options
from outbox.cli.common import Common, add_common, connect, dsn_of, schema_of, schema_owners
from outbox.cli.outboxes import DiscoveryOptions, add_outboxes, choose, is_fleet
from outbox.cli.routes import KafkaOptions, RouteOptions, parse_kafka_config
from outbox.errors import ConfigError, MissingExtra, RelayFailed, SchemaTooNew
from outbox.fleet.fleet import Fleet, Found
from outbox.relay.config import RelayConfig
from outbox.relay.relay import Relay, tune_gc
from outbox.relay.retry import RetryPolicy
from outbox.settings import setting
from outbox.sinks.base import Sink
from outbox.sinks.claim_check import Store, open_store
from outbox.sinks.cloudevents import validate_source
from outbox.sinks.kafka import KafkaSink
from outbox.sinks.make import check_sinks, require_clients, routed
from outbox.sinks.routes import SinkURL, parse_routes
from outbox.sinks.signing import parse_secret_envs, parse_secrets
from outbox.store.dsn import with_net_timeouts
from outbox.store.migrate import require_known
from outbox.store.outboxes import database_of
from outbox.store.pooling import require_own_sessions
from outbox.store.schema import FLEET_SCHEMA
from outbox.store.trust import require_trusted
from outbox.verify import readers
from outbox.verify.outcome import Reader
from outbox.verify.schedule import Schedule, Verifier, VerifyMetrics

log = logging.getLogger("outbox")


@dataclass
class WebhookOptions:
    webhook_secret: str | None = setting(
        None,
        "Standard Webhooks signing secret whsec_<base64> for http(s):// routes; several, "
        "space-separated, give one signature each (rotation). Prefer the variable: a flag shows in ps",
        metavar="whsec_...",
    )
    webhook_secret_env: list[str] = setting(
        default_factory=list,
        help="GLOB=VARIABLE: events whose topic matches GLOB (as routes match, first match wins) "
        "are signed with the whsec_ secrets in the environment variable VARIABLE instead of "
        "--webhook-secret: a secret per receiver, so that one cannot forge requests to another; "
        "repeatable (in the variable: separated by whitespace)",
        metavar="GLOB=VARIABLE",
    )


@dataclass
class CloudEventsOptions:
    cloudevents: bool = setting(
        False,
        "add the CloudEvents 1.0 attributes (binary content mode) as each sink's headers: "
        "id, source, specversion, type, time, subject",
    )
    cloudevents_source: str | None = setting(
        None, "the CloudEvents source attribute, a URI-reference such as /orders-service", metavar="URI"
    )


@dataclass
class ClaimCheckOptions:
    claim_check_over: int | None = setting(
        None,
        "payloads over this many bytes go to the claim-check store; the message carries the "
        "header outbox-claim-check and an empty body",
        default_text="off",
        metavar="BYTES",
    )
    claim_check_store: str | None = setting(
        None,
        "postgres: (a table of the outbox schema) or s3://BUCKET/PREFIX?endpoint=URL&region=R "
        "(boto3, outbox-relay[s3]; credentials from AWS_* or the role)",
        metavar="URL",
    )


@dataclass
class VerifyOptions:
    verify_every: float = setting(
        0.0,
        "read a sample of what was delivered back from the sinks every this many seconds (on its own "
        "thread and connections; outbox_sink_missing_events); 0: never",
        default_text="off",
        metavar="SECONDS",
    )
    verify_window: float = setting(3600.0, "seconds of deliveries each verification looks back over")
    verify_sample: int = setting(100, "one delivery in this many is read back (1: every one)")
    verify_rate: float = setting(1000.0, "deliveries read back a second, at most")


@dataclass
class CustomSink:
    sink: str = setting(
        "kafka",
        "kafka, or MODULE:FACTORY for a custom sink used for kafka:// routes, called as "
        "factory(bootstrap, kafka_config, delivery_timeout)",
    )


def register(sub: Any) -> None:
    p = sub.add_parser("relay", help="publish committed events until SIGTERM/SIGINT")
    add_common(p)
    add_outboxes(p)
    options.add(p, DiscoveryOptions)
    options.add(p, RouteOptions)
    options.add(p, KafkaOptions)
    options.add(p, WebhookOptions)
    options.add(p, CloudEventsOptions)
    options.add(p, ClaimCheckOptions)
    options.add(p, CustomSink)
    options.add(p, VerifyOptions)
    options.add(p, RelayConfig)
    options.add(p, RetryPolicy)
    p.set_defaults(run=cmd_relay)


def relay_config(args: argparse.Namespace) -> RelayConfig:
    retry = options.build(RetryPolicy, args)
    # As ever on the command line, port 0 means no HTTP server (the library takes 0 as "any port").
    port = None if args.metrics_port == 0 else args.metrics_port
    # With a list of outboxes, each names its own database and schema.
    dsn = "" if is_fleet(args) else dsn_of(args)
    return options.build(RelayConfig, args, dsn=dsn, schema=schema_of(args), retry=retry, metrics_port=port)


SinkFactory = Callable[[str, dict[str, str], float], Sink]


def load_sink_factory(spec: str) -> SinkFactory:
    """``kafka`` or ``module:callable`` -> a factory(bootstrap, kafka_config, delivery_timeout)."""
    if spec == "kafka":
        return lambda bootstrap, config, timeout: KafkaSink(bootstrap, config, delivery_timeout=timeout)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"--sink: expected 'kafka' or MODULE:FACTORY, got {spec!r}")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"--sink: cannot load {spec!r}: {exc}") from None
    if not callable(factory):
        raise ConfigError(f"--sink: {spec!r} is not callable")
    built: SinkFactory = factory
    return built


def run_until_signal(relay: Relay | Fleet) -> None:
    """Run ``relay`` in a thread; SIGTERM/SIGINT ask it to stop gracefully; SIGHUP asks a fleet
    to read its list of outboxes again.

    Raises RelayFailed if the relay stopped because it failed (not because it was asked).
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
    if isinstance(relay, Fleet):

        def on_hup(_signum: int, _frame: Any) -> None:
            log.info("received SIGHUP: reading the list of outboxes again")
            relay.reload()

        previous[signal.SIGHUP] = signal.signal(signal.SIGHUP, on_hup)
    try:
        thread.start()
        while thread.is_alive():
            thread.join(0.5)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if failure:
        if isinstance(failure[0], (RelayFailed, MissingExtra)):  # MissingExtra: refused at start
            raise failure[0]
        raise RelayFailed(f"the relay failed: {failure[0]}")


def claim_check_of(args: argparse.Namespace, config: RelayConfig) -> tuple[Store, int] | None:
    """(store, threshold) from --claim-check-over/--claim-check-store, or None when off."""
    over, url = args.claim_check_over, args.claim_check_store
    if over is None and url is None:
        return None
    if over is None or url is None:
        given, missing = (
            ("--claim-check-over", "--claim-check-store")
            if url is None
            else (
                "--claim-check-store",
                "--claim-check-over",
            )
        )
        raise ConfigError(f"{given}: needs {missing} too")
    if over < 1:
        raise ConfigError(f"--claim-check-over: must be >= 1 byte, got {over}")
    return open_store(url, dsn=with_net_timeouts(config.dsn, config.net_timeout), schema=config.schema), over


def cmd_relay(args: argparse.Namespace) -> int:
    routes = parse_routes(args.route, args.kafka_bootstrap)
    require_clients(routes)
    secrets = parse_secrets(args.webhook_secret) if args.webhook_secret else []
    secrets_for = parse_secret_envs(args.webhook_secret_env, os.environ)
    source = validate_source(args.cloudevents_source) if args.cloudevents else None
    if args.cloudevents_source is not None and not args.cloudevents:
        raise ConfigError("--cloudevents-source: given without --cloudevents (which switches CloudEvents on)")
    check_sinks(routes, source)
    config = relay_config(args)
    fleet = is_fleet(args)
    if fleet and (args.claim_check_store or "").startswith("postgres:"):
        raise ConfigError(
            "--claim-check-store: postgres: keeps payloads in the outbox's schema, one relay one outbox; "
            "with several outboxes use s3://"
        )
    claim_check = claim_check_of(args, config)
    from outbox.observe.tracing import configure_from_env

    if configure_from_env():
        log.info("tracing on (OTEL_* environment)")
    kafka_config = parse_kafka_config(args.kafka_config)
    if not fleet:
        # Fail fast on a bad DSN, a transaction pooler or an unmigrated schema, before starting anything.
        # The pooler first: in PgBouncer's statement mode the schema check's own transaction is refused.
        # (With a list of outboxes, one that cannot be served stops only itself: see below.)
        require_own_sessions(config.dsn)
        with connect(args) as conn:
            require_known(conn, config.schema)
            # Its schema and the database's outbox_fleet: code in them runs as the relay.
            require_trusted(conn, [config.schema, FLEET_SCHEMA], schema_owners(args))

    sink = routed(
        routes,
        config.delivery_timeout,
        kafka=load_sink_factory(args.sink),
        kafka_config=kafka_config,
        webhook_secrets=secrets,
        cloudevents_source=source,
        claim_check=claim_check,
        webhook_secrets_for=secrets_for,
    )

    sink().close(0)  # validates every sink's configuration now, with a clear error
    log.info("routes: %s", ", ".join(r.display for r in routes))
    if source is not None:
        log.info("CloudEvents on: binary content mode, source %s", source)
    if claim_check is not None:
        log.info("claim-check on: payloads over %d bytes go to %s", claim_check[1], claim_check[0].name)
    tune_gc()
    runner: Relay | Fleet
    if fleet:
        discover_every = args.discover_every if args.schemas else None
        if discover_every is not None and not discover_every > 0:
            raise ConfigError(f"--discover-every: must be > 0 seconds, got {discover_every:g}")
        runner = Fleet(config, sink, _finder(args), discover_every=discover_every)
    else:
        runner = Relay(config, sink)
    verifier = _verifier(args, runner, routes, kafka_config)
    try:
        run_until_signal(runner)
    finally:
        if verifier is not None:
            verifier.stop()
    return 0


def _verifier(
    args: argparse.Namespace, runner: Relay | Fleet, routes: list[Any], kafka_config: dict[str, str]
) -> Verifier | None:
    """The relay's own verifications (--verify-every), started; None when off."""
    opts = options.build(VerifyOptions, args)
    if not opts.verify_every:
        return None
    for name in ("verify_every", "verify_window", "verify_rate"):
        if getattr(opts, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(opts, name):g}")
    if opts.verify_sample < 1:
        raise ConfigError(f"--verify-sample: must be >= 1, got {opts.verify_sample}")
    schedule = Schedule(opts.verify_every, opts.verify_window, opts.verify_sample, opts.verify_rate)
    metrics = VerifyMetrics(runner.metrics.sink_missing, runner.metrics.verify_checked)

    def reader_for(url: SinkURL) -> Reader | None:
        return readers.reader_for(url, kafka_config=kafka_config)

    verifier = Verifier(lambda: runner.outboxes, routes, reader_for, metrics, schedule)
    verifier.start()
    log.info(
        "verifying one delivery in %d of the last %g s every %g s", opts.verify_sample, opts.verify_window,
        opts.verify_every,
    )  # fmt: skip
    return verifier


def _finder(args: argparse.Namespace) -> Callable[[], Found | None]:
    """The outboxes the options name, looked up again on each call (discovery, SIGHUP). What cannot
    be served is said once, when first seen, and again only if the reason changes; a database
    behind a transaction pooler is refused (the relay needs sessions of its own)."""
    said: dict[str, str] = {}
    pooled: dict[Any, str | None] = {}
    known: set[tuple[str, str]] = set()  # found migrated by an earlier look

    def find() -> Found | None:
        try:
            chosen = choose(args, known=known)
        except ConfigError as exc:  # the file became unreadable or wrong: keep everything as it is
            log.error("the list of outboxes cannot be read, nothing changes: %s", exc)
            return None
        _refuse_newer(args, chosen, known)
        outboxes = []
        for o in chosen.outboxes:
            if o.database not in pooled:
                try:
                    require_own_sessions(o.dsn)
                    pooled[o.database] = None
                except ConfigError as exc:
                    pooled[o.database] = str(exc)
            if pooled[o.database] is not None:
                chosen.skipped[o.name] = str(pooled[o.database])
                continue
            outboxes.append(o)
        for what, why in chosen.skipped.items():
            if said.get(what) != why:
                log.error(
                    "%s is not served: %s", what, why, extra={"event": "outbox.skipped", "outbox": what}
                )
                said[what] = why
        known.clear()  # only what this look served: a dropped tenant is forgotten
        known.update((o.dsn, o.schema) for o in chosen.outboxes)
        return Found(outboxes, unreadable={database_of(dsn) for dsn in chosen.unreachable})

    return find


def _refuse_newer(args: argparse.Namespace, chosen: Any, known: set[tuple[str, str]]) -> None:
    """Of the outboxes chosen and not served before, those migrated past what this version knows
    (a newer version's migrate ran) are skipped, each with one line naming the versions; the
    rest are served. One connection per database; a database that cannot be reached is left to
    the relay's own handling of it."""
    by_dsn: dict[str, list[Any]] = {}
    for o in chosen.outboxes:
        if (o.dsn, o.schema) not in known:
            by_dsn.setdefault(o.dsn, []).append(o)
    refused: set[str] = set()
    for dsn, outboxes in by_dsn.items():
        try:
            with connect(args, dsn) as conn:
                conn.autocommit = True
                for o in outboxes:
                    try:
                        require_known(conn, o.schema, "schema")
                    except SchemaTooNew as exc:
                        chosen.skipped[o.name] = str(exc)
                        refused.add(o.name)
                    except (ConfigError, psycopg.Error):  # not migrated, gone: the lane says so
                        continue
        except (ConfigError, psycopg.Error):
            continue
    chosen.outboxes = [o for o in chosen.outboxes if o.name not in refused]


__all__ = ["Common", "KafkaOptions", "cmd_relay", "register", "relay_config"]
