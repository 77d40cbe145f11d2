"""A network that fails silently: the relay's PostgreSQL traffic, or its broker's, frozen by a
loopback proxy (sockets open, no bytes, no reset) while writers keep committing straight to
PostgreSQL. /readyz must turn 503 within 15 s and say why, /livez stay 200; when the network
heals the relay is ready again and drains the backlog (for the broker: without waiting out the
failed events' backoff), and nothing is lost or archived twice."""

from __future__ import annotations

import threading
import time

import psycopg
from outbox_bench.harness.proxy import Proxy
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

import outbox
from outbox.harness.embedded import Broker, free_port
from outbox.relay.config import RelayConfig
from outbox.relay.relay import Relay
from outbox.relay.retry import RetryPolicy
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from tests.helpers import count, http_get, running_relay, wait_for
from tests.sink_servers import HttpTarget

READY_WITHIN = 15.0  # seconds from the blackhole to /readyz 503 (the target)
FROZEN = 25.0  # seconds the network stays silent


def _writer(dsn: str, schema: str, topic: str, stop: threading.Event, written: list[int]) -> None:
    """About 50 transactions a second, straight to PostgreSQL (not through the proxy)."""
    with psycopg.connect(dsn) as conn:
        i = 0
        while not stop.is_set():
            outbox.enqueue(conn, topic, {"i": i}, key=f"k{i % 10}", schema=schema)
            conn.commit()
            written.append(i)
            i += 1
            time.sleep(0.02)


def _freeze_until_not_ready(proxy: Proxy, port: int) -> tuple[float, str]:
    """Freeze the proxy; (seconds until /readyz said 503, its body). /livez must stay 200."""
    proxy.freeze()
    frozen_at = time.monotonic()
    _, body = wait_for(
        lambda: (lambda r: r if r[0] == 503 else None)(http_get(port, "/readyz")),
        timeout=READY_WITHIN + 5,
        what="/readyz 503",
    )
    not_ready_after = time.monotonic() - frozen_at
    assert not_ready_after <= READY_WITHIN, f"/readyz 503 after {not_ready_after:.1f} s"
    assert http_get(port, "/livez")[0] == 200, "waiting for the network is not a reason to restart"
    return not_ready_after, body


def _archived_once(dsn: str, schema: str, written: int) -> None:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT count(*), count(DISTINCT event_id) FROM {}.delivered").format(
                sql.Identifier(schema)
            )
        ).fetchone()
    assert row == (written, written), "every committed event archived exactly once"


def test_a_postgres_blackhole_turns_readyz_503_in_time_and_heals_without_loss(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    target = conninfo_to_dict(pg_dsn)
    proxy = Proxy(str(target.get("host") or "127.0.0.1"), int(target.get("port") or 5432)).start()
    relay_dsn = make_conninfo(pg_dsn, host="127.0.0.1", port=str(proxy.port))
    config = RelayConfig(relay_dsn, schema=schema, metrics_port=0, poll_interval=0.2)
    stop = threading.Event()
    written: list[int] = []
    writer = threading.Thread(target=_writer, args=(pg_dsn, schema, topic, stop, written))
    try:
        with running_relay(config, bootstrap=kafka) as relay:
            writer.start()
            wait_for(lambda: relay.stats.delivered > 50, timeout=30, what="flowing")
            port = relay.http.port  # type: ignore[union-attr]
            assert http_get(port, "/readyz")[0] == 200

            frozen_at = time.monotonic()
            not_ready_after, body = _freeze_until_not_ready(proxy, port)
            assert body.startswith(("stalled:", "database unreachable")), body
            time.sleep(2)
            metrics = http_get(port, "/metrics")[1]  # the condition and its duration, as metrics
            assert "\noutbox_ready 0\n" in metrics, metrics[-800:]
            not_ready_for = float(metrics.split("\noutbox_not_ready_seconds ", 1)[1].split()[0])
            assert not_ready_for >= 1.5, metrics[-800:]
            assert (
                'outbox_not_ready{reason="stalled"} 1' in metrics
                or 'outbox_not_ready{reason="database"} 1' in metrics
            )
            time.sleep(max(0.0, FROZEN - (time.monotonic() - frozen_at)))

            proxy.heal()
            healed_at = time.monotonic()
            wait_for(lambda: http_get(port, "/readyz")[0] == 200, timeout=60, what="/readyz 200 again")
            metrics = http_get(port, "/metrics")[1]
            assert "\noutbox_ready 1\n" in metrics and "\noutbox_not_ready_seconds 0\n" in metrics
            assert "outbox_not_ready{" not in metrics
            stop.set()
            writer.join(10)
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=90, what="backlog drained")
            drained_after = time.monotonic() - healed_at
    finally:
        stop.set()
        proxy.stop()
    _archived_once(pg_dsn, schema, len(written))
    print(f"readyz 503 after {not_ready_after:.1f} s; drained {drained_after:.1f} s after healing")


def _blackhole_then_heal(
    relay: Relay,
    proxy: Proxy,
    pg_dsn: str,
    schema: str,
    failed_kind: str,
    stop: threading.Event,
    writer: threading.Thread,
    delivery_timeout: float,
) -> tuple[float, float]:
    """Flowing, then frozen until /readyz says 503 (a sink's reason); once events have failed
    with ``failed_kind`` the writer stops, and the network stays frozen until nothing can be in
    flight (20 s from the freeze, and at least three delivery timeouts): after healing, the
    only way back before the failed events' backoff ends is a probe the sink answers. Returns
    (seconds to not ready, seconds from healing to an empty backlog, which must be < 20)."""
    writer.start()
    wait_for(lambda: relay.stats.delivered > 50, timeout=30, what="flowing")
    port = relay.http.port  # type: ignore[union-attr]
    frozen_at = time.monotonic()
    not_ready_after, body = _freeze_until_not_ready(proxy, port)
    # Kafka: a producer given up at the deadline counts as unhealthy until the relay replaces it.
    assert body.startswith(("stalled:", "sink down:", "sink unhealthy: kafka://")), body
    wait_for(
        lambda: count(pg_dsn, schema, "events", f"last_error_kind = '{failed_kind}'") > 0,
        timeout=30,
        what=f"events failed ({failed_kind})",
    )
    stop.set()
    writer.join(10)
    time.sleep(max(3 * delivery_timeout, 20.0 - (time.monotonic() - frozen_at)))
    proxy.heal()
    healed_at = time.monotonic()
    wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=28, what="backlog drained")
    drained_after = time.monotonic() - healed_at
    assert drained_after < 20, f"drained {drained_after:.1f} s after healing"
    wait_for(lambda: http_get(port, "/readyz")[0] == 200, timeout=30, what="/readyz 200 again")
    return not_ready_after, drained_after


def test_a_broker_blackhole_turns_readyz_503_and_retries_resume_when_it_answers(
    pg_dsn: str, schema: str, topic: str
) -> None:
    """The broker behind a proxy that freezes (clients are told the proxy's port). The producer
    is given up at the delivery timeout, its events failed as unreachable, with a 60 s backoff here; once the broker answers
    a probe (a metadata request) they are due at once, well before that backoff would end."""
    broker_port = free_port()
    proxy = Proxy("127.0.0.1", broker_port).start()
    broker = Broker(broker_port, advertised_port=proxy.port).start()
    slow = RetryPolicy(base=60.0, cap=120.0, max_attempts=100)
    config = RelayConfig(
        pg_dsn, schema=schema, metrics_port=0, poll_interval=0.2, delivery_timeout=4.0, lease=10.0, retry=slow
    )
    stop = threading.Event()
    written: list[int] = []
    writer = threading.Thread(target=_writer, args=(pg_dsn, schema, topic, stop, written))
    try:
        with running_relay(config, bootstrap=broker.bootstrap) as relay:
            not_ready_after, drained_after = _blackhole_then_heal(
                relay, proxy, pg_dsn, schema, "producer_failed", stop, writer, config.delivery_timeout
            )
    finally:
        stop.set()
        proxy.stop()
        broker.stop()
    _archived_once(pg_dsn, schema, len(written))
    print(f"readyz 503 after {not_ready_after:.1f} s; drained {drained_after:.1f} s after healing")


def test_a_webhook_blackhole_turns_readyz_503_and_retries_resume_when_the_receiver_answers_a_probe(
    pg_dsn: str, schema: str
) -> None:
    """The receiver behind a proxy that freezes. Requests time out; with nothing confirmed for a
    whole timeout the sink counts as down, and the relay probes it (an unsigned OPTIONS request)
    with each heartbeat. Failed events have a 60 s backoff here; the first probe answered after
    healing makes them due at once. The probes are not events: the receiver sees no extra POST."""
    sink = HttpTarget()
    proxy = Proxy(*sink.server).start()
    slow = RetryPolicy(base=60.0, cap=120.0, max_attempts=100)
    config = RelayConfig(
        pg_dsn, schema=schema, metrics_port=0, poll_interval=0.2, delivery_timeout=4.0, lease=10.0, retry=slow
    )
    factory = routed(parse_routes([f"*={sink.url('127.0.0.1', proxy.port)}"], None), config.delivery_timeout)
    stop = threading.Event()
    written: list[int] = []
    writer = threading.Thread(target=_writer, args=(pg_dsn, schema, sink.topic, stop, written))
    try:
        with running_relay(config, factory) as relay:
            not_ready_after, drained_after = _blackhole_then_heal(
                relay, proxy, pg_dsn, schema, "timeout", stop, writer, config.delivery_timeout
            )
        with sink.receiver.lock:
            methods = [r.method for r in sink.receiver.requests]
    finally:
        stop.set()
        proxy.stop()
        sink.close()
    assert "OPTIONS" in methods, "the relay probed the receiver"
    _archived_once(pg_dsn, schema, len(written))
    delivered_ids = {m.event_id for m in sink.read(len(written))}
    assert len(delivered_ids) == len(written), "every committed event reached the receiver"
    print(f"readyz 503 after {not_ready_after:.1f} s; drained {drained_after:.1f} s after healing")
