"""Pure logic: retry schedule, encoding, error classification, secret redaction."""

from __future__ import annotations

import random
import uuid
from datetime import datetime, timezone

import pytest
from confluent_kafka import KafkaError

from outbox import queries
from outbox.batch import int_array
from outbox.dsn import redact, scrub, secrets_of
from outbox.events import CorruptEvent, decode_row, encode_event, encode_headers
from outbox.retry import MAX_ERROR_CHARS, RetryPolicy, cap_error
from outbox.sinks.base import Dead, Retry
from outbox.sinks.kafka import build_config, classify, redacted


def test_backoff_grows_exponentially_within_jitter_and_cap() -> None:
    policy = RetryPolicy(base=1.0, cap=60.0, max_attempts=10)
    rng = random.Random(1)
    for attempt in range(1, 12):
        step = min(60.0, 2.0 ** (attempt - 1))
        for _ in range(50):
            d = policy.next_delay(attempt, rng)
            assert step / 2 <= d <= step
    assert policy.next_delay(1000, rng) <= 60.0


def test_exhaustion_and_validation() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert not policy.exhausted(2)
    assert policy.exhausted(3)
    with pytest.raises(ValueError, match="base"):
        RetryPolicy(base=0)
    with pytest.raises(ValueError, match="cap"):
        RetryPolicy(base=10, cap=1)
    with pytest.raises(ValueError, match="max attempts"):
        RetryPolicy(max_attempts=0)


def test_error_text_is_capped() -> None:
    assert cap_error("short") == "short"
    capped = cap_error("x" * 10_000)
    assert len(capped) == MAX_ERROR_CHARS and capped.endswith("(truncated)")


def test_json_payload_gets_content_type_unless_given() -> None:
    ev = encode_event("t", {"a": [1, 2]})
    assert ev.payload == b'{"a":[1,2]}'
    assert ev.headers["content-type"] == "application/json"
    ev = encode_event("t", {"a": 1}, headers={"content-type": "application/vnd.x+json"})
    assert ev.headers["content-type"] == "application/vnd.x+json"
    assert "content-type" not in encode_event("t", b"raw").headers


def test_explicit_traceparent_wins_over_the_active_context() -> None:
    ev = encode_event("t", b"x", headers={"traceparent": "mine"}, trace_headers={"traceparent": "ctx"})
    assert ev.headers["traceparent"] == "mine"


def test_headers_round_trip_byte_exact() -> None:
    raw = {"text": "caf\u00e9", "bin": b"\xff\x00", "utf8-bytes": "\u00e9".encode(), "nul": "a\x00"}
    row = (1, str(uuid.uuid4()), "t", None, b"p", encode_headers(raw), datetime.now(timezone.utc), 0)
    decoded = dict(decode_row(row).headers)
    assert decoded["text"] == "caf\u00e9".encode()
    assert decoded["bin"] == b"\xff\x00"
    assert decoded["utf8-bytes"] == "\u00e9".encode()
    assert decoded["nul"] == b"a\x00"
    assert decoded["event-id"] == row[1].encode()


@pytest.mark.parametrize("headers", [[1, 2], {"h": 1}, {"h": {"b64": "!!"}}, {"h": {"x": "y"}}])
def test_corrupt_rows_are_named(headers: object) -> None:
    row = (1, str(uuid.uuid4()), "t", None, b"p", headers, datetime.now(timezone.utc), 0)
    with pytest.raises(CorruptEvent, match="headers"):
        decode_row(row)


def test_int_arrays_as_literals() -> None:
    assert int_array([1, None, 3]) == "{1,NULL,3}"
    assert int_array([]) == "{}"


def test_kafka_errors_are_classified() -> None:
    assert isinstance(classify(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE)), Dead)
    assert isinstance(classify(KafkaError(KafkaError.TOPIC_EXCEPTION)), Dead)
    assert isinstance(classify(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)), Dead)
    assert isinstance(classify(KafkaError(KafkaError._MSG_TIMED_OUT)), Retry)
    assert isinstance(classify(KafkaError(KafkaError._TRANSPORT)), Retry)


def test_kafka_config_keeps_the_guarantees() -> None:
    config = build_config("b:9092", {"linger.ms": "20", "sasl.password": "s3cret"}, 15.0)
    assert config["enable.idempotence"] == "true" and config["acks"] == "all"
    assert config["linger.ms"] == "20"
    assert config["message.timeout.ms"] == 15000
    assert "s3cret" not in str(redacted(config))
    with pytest.raises(ValueError, match=r"enable\.idempotence"):
        build_config("b:9092", {"enable.idempotence": "false"}, 15.0)
    with pytest.raises(ValueError, match="acks"):
        build_config("b:9092", {"acks": "1"}, 15.0)


@pytest.mark.parametrize(
    "dsn",
    [
        "postgresql://app:s3cret@db:5432/app",
        "host=db user=app password=s3cret dbname=app",
        "host=db password='s3cret' user=app",
    ],
)
def test_dsn_password_is_redacted(dsn: str) -> None:
    assert "s3cret" not in redact(dsn)
    assert secrets_of(dsn) == ["s3cret"]
    assert scrub(f"failed for {dsn}", secrets_of(dsn)).count("s3cret") == 0


def test_every_named_query_binds_the_schema() -> None:
    for name in queries.names():
        text = queries.query(name, 'we"ird', state="ENABLE").as_string()
        assert "{schema}" not in text
    with pytest.raises(KeyError):
        queries.query("nope", "outbox")


def test_hygiene_vacuums_when_dead_tuples_dominate_not_mid_drain() -> None:
    import threading

    from outbox.hygiene import Hygiene

    h = Hygiene("", "outbox", threading.Event(), threshold=20_000)
    assert h.needs_vacuum(dead=25_000, live=300, size=10 << 20)  # steady state: bloat
    assert not h.needs_vacuum(dead=25_000, live=400_000, size=100 << 20)  # big backlog draining
    assert not h.needs_vacuum(dead=5_000, live=3_000, size=2 << 20)  # below the threshold, not drained
    assert h.needs_vacuum(dead=5_000, live=0, size=2 << 20)  # drained but large: truncate
    assert not h.needs_vacuum(dead=5_000, live=0, size=100_000)  # drained and small
    assert h.needs_vacuum(dead=19_000, live=12, size=4 << 20)  # drained, stats drifted a little
