"""The AWS sinks against moto in server mode: SQS (standard and FIFO), SNS, EventBridge, Kinesis.

Each test runs on each service, with a queue, topic, bus or stream of its own
(tests/aws_servers.py, which also says what moto proves and what it does not).
"""

from __future__ import annotations

import json
import time
from typing import Any

import psycopg
import pytest
from outbox_bench.harness.proxy import Proxy

import outbox
from outbox.relay.config import RelayConfig
from outbox.relay.retry import RetryPolicy
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from tests.aws_servers import AWS_SINKS, AwsProxy, AwsTarget, KinesisTarget, Moto, aws_target
from tests.helpers import (
    FAST,
    RelayProcess,
    assert_per_key_order,
    count,
    running_relay,
    wait_for,
    write_rounds,
)

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


@pytest.fixture(params=AWS_SINKS)
def target(request: pytest.FixtureRequest, moto_server: Moto, aws_env: dict[str, str]) -> AwsTarget:
    return aws_target(request.param, moto_server)


def _config(pg_dsn: str, schema: str, **kw: Any) -> RelayConfig:
    base: dict[str, Any] = {"poll_interval": 0.1, "delivery_timeout": 5.0, "lease": 10.0}
    return RelayConfig(pg_dsn, schema=schema, **{**base, **kw})


def _factory(config: RelayConfig, *routes: str) -> Any:
    return routed(parse_routes(list(routes), None), config.delivery_timeout)


def _archive(pg_dsn: str, schema: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(pg_dsn) as conn:
        return conn.execute(
            f'SELECT event_id, sink_partition, sink_offset, sink_ref FROM "{schema}".delivered ORDER BY id'
        ).fetchall()


def _dead(pg_dsn: str, schema: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(pg_dsn) as conn:
        return conn.execute(f'SELECT event_id, error FROM "{schema}".dead_letters').fetchall()


def test_delivers_byte_exact_with_its_attributes_and_coordinates(
    pg_dsn: str, schema: str, target: AwsTarget
) -> None:
    payload = {"order": 42, "items": ["a", "ü"], "total": "9.99"}
    headers = {"content-type": "application/json", "traceparent": TRACEPARENT, "tenant": "acme"}
    many = {f"h{i}": f"v{i}" for i in range(12)}  # more headers than SQS/SNS attributes
    with psycopg.connect(pg_dsn) as conn:
        first = outbox.enqueue(conn, target.topic, payload, key="order-42", headers=headers, schema=schema)
        crowded = outbox.enqueue(conn, target.topic, {"n": 1}, key="k2", headers=many, schema=schema)
        raw = outbox.enqueue(conn, target.topic, b"\x00\xffraw", key=None, schema=schema)
        conn.commit()
        outbox.enqueue(conn, target.topic, {"rolled": "back"}, key="order-42", schema=schema)
        conn.rollback()
    config = _config(pg_dsn, schema)
    with running_relay(config, _factory(config, f"*={target.url()}")):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="drain")
    json_only = target.kind == "eventbridge"
    got = {m.event_id: m for m in target.read(2 if json_only else 3)}
    assert all(b"rolled" not in m.value for m in got.values())
    one, two = got[str(first)], got[str(crowded)]
    assert json.loads(one.value) == payload and json.loads(two.value) == {"n": 1}
    archive = {str(r[0]): r[1:] for r in _archive(pg_dsn, schema)}
    if json_only:
        # EventBridge takes JSON objects only: the raw payload is a dead letter saying so.
        [(dead_id, error)] = _dead(pg_dsn, schema)
        assert dead_id == raw and "takes a JSON object as the event's Detail" in error, error
        assert one.headers["x-detail-type"] == target.topic.encode()
        assert one.headers["x-source"] == b"orders-service"
        assert archive[str(first)][2] == one.headers["x-eventbridge-id"].decode()
        return
    assert got[str(raw)].value == b"\x00\xffraw"  # SQS/SNS: as base64, decoded back
    if isinstance(target, KinesisTarget):
        assert one.key == b"order-42" and got[str(raw)].key is None
        shard, seq = archive[str(first)][0], archive[str(first)][2]
        assert (
            one.headers["x-shard"].decode().endswith(f"{shard:012d}")
            and one.headers["x-sequence"].decode() == seq
        )
    else:
        assert one.key == b"order-42" and got[str(raw)].key is None
        if target.kind == "sns":  # the SNS message id (the subscription's queue gives its own)
            assert archive[str(first)][2] and archive[str(first)][2] != one.headers["x-message-id"].decode()
        else:
            assert archive[str(first)][2].split("/")[0] == one.headers["x-message-id"].decode()
        if target.kind == "sqs-fifo":
            assert one.headers["x-group"] == b"order-42"
            assert archive[str(first)][2].split("/")[1] == one.headers["x-sequence"].decode()
            assert got[str(raw)].headers["x-group"] == str(raw).encode()  # keyless: its own group
    for name, value in {**headers}.items():
        assert one.headers[name] == value.encode(), name
    for name, value in many.items():  # past the tenth attribute: in outbox-headers, none lost
        assert two.headers[name] == value.encode(), name


@pytest.mark.slow
def test_per_key_order_through_failures_and_two_relay_processes(
    pg_dsn: str, schema: str, target: AwsTarget, aws_env: dict[str, str]
) -> None:
    # 200 events, 5 % of sends failing (a third of them after the send): about ten failures,
    # each holding its key across two relays. moto answers one request at a time and its FIFO
    # send scans the queue, so 500 took minutes of the suite's CPU and showed nothing more.
    keys, rounds = 10, 20
    env = {"OUTBOX_TEST_FAILURE_RATE": "0.05", **aws_env}
    # moto answers a FIFO send in 50-500 ms (it scans the queue for duplicates), where SQS takes
    # tens of ms: a batch of 200 whose keys each go one at a time outlives FAST's 4 s lease, its
    # ack is refused and it starts over. A longer lease and smaller batches, for moto. And a longer
    # delivery timeout: on a machine running at half its pace, FAST's 2 s timed out the two relays'
    # requests queued behind one another at moto, they came again, and for 60 s every connection
    # timed out (SNS, a CI run, 2026-11-26).
    opts = (*FAST, "--lease", "30", "--delivery-timeout", "10", "--batch-size", "100")
    opts = (*opts, "--route", f"*={target.url()}")
    relays = [
        RelayProcess(pg_dsn, schema, None, *opts, "--name", f"r{i}", env=env, module="tests.flaky_relay")
        for i in range(2)
    ]
    try:
        with target.draining():
            write_rounds(pg_dsn, schema, target.topic, keys, rounds)
            try:
                wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=120, what="drain")
            except AssertionError:
                with psycopg.connect(pg_dsn) as conn:
                    errors = conn.execute(
                        f'SELECT last_error, count(*) FROM "{schema}".events GROUP BY 1 ORDER BY 2 DESC LIMIT 5'
                    ).fetchall()
                tails = "\n".join(r.output()[-2000:] for r in relays)
                raise AssertionError(f"not drained; pending by last error: {errors}\n{tails}") from None
        for r in relays:
            assert r.stop() == 0, r.output()[-3000:]
        got = target.read(keys * rounds)
    finally:
        for r in relays:
            r.close()
    assert count(pg_dsn, schema, "delivered") == keys * rounds  # each archived once
    assert count(pg_dsn, schema, "delivered", "attempts > 1") > 0, "no failure was injected"
    assert len({m.event_id for m in got}) == keys * rounds
    assert_per_key_order(got)
    assert count(pg_dsn, schema, "dead_letters") == 0


@pytest.mark.slow
def test_the_endpoint_down_for_a_while_then_back_loses_nothing(
    pg_dsn: str,
    schema: str,
    target: AwsTarget,
    moto_server: Moto,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every connection to the endpoint reset and new ones refused mid-stream, then healed:
    nothing lost, each event archived once, per-key order kept, the outage one line each way.
    The reconnects reuse the sink's botocore session: a new one per attempt loaded the service's
    model again inside the connect timeout, and a starved relay could not reconnect for a minute."""
    import aiobotocore.session

    sessions = []
    real_session = aiobotocore.session.get_session
    monkeypatch.setattr(aiobotocore.session, "get_session", lambda: sessions.append(1) or real_session())
    proxy = Proxy("127.0.0.1", moto_server.port).start()
    keys, rounds = 10, 12
    retry = RetryPolicy(base=0.05, cap=0.5, max_attempts=1000)
    # moto, loaded by a parallel suite, can take seconds to answer: 2 s made a healed endpoint
    # look down again, and so did 5 s once in a CI run on a machine running twice as slow (three
    # outage starts). A refused connection fails at once whatever the timeout.
    config = _config(pg_dsn, schema, delivery_timeout=10.0, lease=20.0, retry=retry)
    try:
        url = target.url(f"http://127.0.0.1:{proxy.port}")
        with running_relay(config, _factory(config, f"*={url}")) as relay:
            write_rounds(pg_dsn, schema, target.topic, keys, rounds // 3)
            wait_for(lambda: count(pg_dsn, schema, "delivered") >= keys, timeout=30, what="flowing")
            proxy.refuse()
            write_rounds(pg_dsn, schema, target.topic, keys, rounds // 3, rounds // 3)
            wait_for(lambda: relay.stats.retried > 0, timeout=30, what="failed attempts")
            time.sleep(3.0)
            proxy.heal()
            write_rounds(pg_dsn, schema, target.topic, keys, rounds // 3, 2 * (rounds // 3))
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="drain after")
    finally:
        proxy.stop()
    got = target.read(keys * rounds)
    assert count(pg_dsn, schema, "delivered") == keys * rounds
    assert len({m.event_id for m in got}) == keys * rounds
    assert_per_key_order(got)
    events = [getattr(r, "event", "") for r in caplog.records]
    outage = [e for e in events if e.startswith(f"{target.scheme}.")]
    assert outage and outage[0] == f"{target.scheme}.started" and outage[-1] == f"{target.scheme}.ended", (
        outage
    )
    assert outage.count(f"{target.scheme}.started") <= 2, outage  # as for every sink (test_sinks.py)
    assert relay.stats.retried > 0 and len(sessions) == 1, len(sessions)


def test_a_refused_event_is_dead_lettered_with_the_services_reason_and_parks_its_key(
    pg_dsn: str, schema: str, target: AwsTarget
) -> None:
    """The service answers AccessDenied to any call holding one event (as IAM would for a
    message it may not send): the sink sends that batch's entries one by one, so only that
    event is dead-lettered, with the service's code and message; its key is parked behind it."""
    proxy = AwsProxy(("127.0.0.1", target.moto.port))
    proxy.refuse("refuse-me")
    try:
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue(conn, target.topic, {"v": "a1"}, key="a", schema=schema)
            refused = outbox.enqueue(conn, target.topic, {"v": "refuse-me"}, key="a", schema=schema)
            outbox.enqueue(conn, target.topic, {"v": "a3"}, key="a", schema=schema)
            for i in range(5):
                outbox.enqueue(conn, target.topic, {"v": f"b{i}"}, key="b", schema=schema)
        config = _config(pg_dsn, schema)
        with running_relay(config, _factory(config, f"*={target.url(proxy.endpoint)}")):
            wait_for(lambda: count(pg_dsn, schema, "delivered") == 6, timeout=30, what="the rest")
            wait_for(lambda: count(pg_dsn, schema, "dead_letters") == 1, timeout=30, what="the dead letter")
            with psycopg.connect(pg_dsn) as conn:
                pending = conn.execute(f'SELECT payload FROM "{schema}".events').fetchall()
    finally:
        proxy.close()
    [(event_id, error)] = _dead(pg_dsn, schema)
    assert event_id == refused and ("AccessDeniedException" in error or "AuthorizationError" in error), error
    assert "not authorized" in error and target.resource in error
    assert [json.loads(bytes(p[0])) for p in pending] == [{"v": "a3"}]  # parked behind its dead letter
    values = sorted(json.loads(m.value)["v"] for m in target.read(6))
    assert values == ["a1", "b0", "b1", "b2", "b3", "b4"]


def test_throttling_is_retried_with_backoff_and_loses_nothing(
    pg_dsn: str, schema: str, target: AwsTarget
) -> None:
    proxy = AwsProxy(("127.0.0.1", target.moto.port))
    proxy.throttle(4)
    try:
        write_rounds(pg_dsn, schema, target.topic, 5, 4)
        config = _config(pg_dsn, schema, retry=RetryPolicy(base=0.05, cap=0.3, max_attempts=100))
        with running_relay(config, _factory(config, f"*={target.url(proxy.endpoint)}")):
            wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30, what="drain")
    finally:
        proxy.close()
    assert proxy.throttled == 4
    assert count(pg_dsn, schema, "delivered") == 20 and count(pg_dsn, schema, "dead_letters") == 0
    assert count(pg_dsn, schema, "delivered", "attempts > 1") > 0
    got = target.read(20)
    assert len({m.event_id for m in got}) == 20
    assert_per_key_order(got)


@pytest.mark.parametrize("kind", ["sqs", "eventbridge"])
def test_no_secret_reaches_the_logs_and_a_missing_region_or_queue_is_one_line(
    pg_dsn: str, schema: str, kind: str, moto_server: Moto, aws_env: dict[str, str]
) -> None:
    """The relay as a process, with a secret access key and a session token in its environment,
    through refusals, throttling and an endpoint that goes away: neither appears in its output.
    A route without a region refuses to start, in one line; a queue that does not exist is an
    outage of that sink (retried), named in the log and in /readyz, not a dead letter."""
    secret, token = "wJalrXUtnFEMI-K7MDENG-bPxRfiCYzzSECRET", "FwoGZXIvYXdzEBYaDSESSIONTOKEN"
    env = {**aws_env, "AWS_SECRET_ACCESS_KEY": secret, "AWS_SESSION_TOKEN": token}
    target = aws_target(kind, moto_server)
    proxy = AwsProxy(("127.0.0.1", moto_server.port))
    proxy.throttle(2)
    proxy.refuse("refuse-me")
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, target.topic, {"v": "refuse-me"}, key="a", schema=schema)
        outbox.enqueue(conn, target.topic, {"v": "ok"}, key="b", schema=schema)
    missing = f"{target.scheme}://does-not-exist?region=us-east-1&endpoint={moto_server.endpoint}"
    if kind == "eventbridge":
        missing += "&source=s"
    relay = RelayProcess(
        pg_dsn, schema, None, *FAST, "--route", f"orders.*={target.url(proxy.endpoint)}",
        "--route", f"*={missing}", env=env,
    )  # fmt: skip
    try:
        with psycopg.connect(pg_dsn) as conn:
            outbox.enqueue(conn, "other.topic", {"v": "nowhere"}, key="c", schema=schema)
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 1, timeout=30, what="delivery")
        wait_for(lambda: count(pg_dsn, schema, "dead_letters") == 1, timeout=30, what="the refusal")
        wait_for(
            lambda: "does-not-exist" in relay.output(), timeout=30, what="the missing destination logged"
        )
        assert count(pg_dsn, schema, "events") == 1  # the missing queue's event waits, not dead
        assert relay.stop() == 0
    finally:
        proxy.close()
        out = relay.output()
        relay.close()
    assert secret not in out and token not in out
    assert secret not in str(_dead(pg_dsn, schema))
    if kind != "sqs":
        return
    no_region = RelayProcess(
        pg_dsn, schema, None, "--route", f"*={target.scheme}://{target.resource}",
        env={**env, "AWS_DEFAULT_REGION": "", "AWS_REGION": ""},
    )  # fmt: skip
    try:  # closed whatever happens: a relay that does start must not outlive the test
        code = no_region.proc.wait(30)
        err = no_region.output()
    finally:
        no_region.close()
    assert code == 2 and "no AWS region" in err and "Traceback" not in err and secret not in err, err
