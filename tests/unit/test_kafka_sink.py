"""outbox.sinks.kafka: error classification and producer configuration (pure)."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from outbox.conditions import Condition
from outbox.errors import ConfigError
from outbox.sinks.base import Dead, Retry
from outbox.sinks.kafka import _ClientLog, build_config, classify, redacted


def test_kafka_errors_are_classified_with_their_kind() -> None:
    for code in (
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
    ):
        outcome = classify(KafkaError(code))
        assert isinstance(outcome, Dead)
        assert outcome.kind == KafkaError(code).name()
        assert outcome.reason.startswith(outcome.kind + ": ")
    for code in (KafkaError._MSG_TIMED_OUT, KafkaError._TRANSPORT):
        retry = classify(KafkaError(code))
        assert isinstance(retry, Retry) and retry.kind == KafkaError(code).name()


def test_kafka_config_keeps_the_guarantees() -> None:
    config = build_config("b:9092", {"linger.ms": "20", "sasl.password": "s3cret"}, 15.0)
    assert config["enable.idempotence"] == "true" and config["acks"] == "all"
    assert config["linger.ms"] == "20"
    assert config["message.timeout.ms"] == 15000
    assert "s3cret" not in str(redacted(config))
    with pytest.raises(ConfigError, match=r"enable\.idempotence"):
        build_config("b:9092", {"enable.idempotence": "false"}, 15.0)
    with pytest.raises(ConfigError, match="acks"):
        build_config("b:9092", {"acks": "1"}, 15.0)


def test_librdkafka_connection_failures_feed_one_condition(caplog: pytest.LogCaptureFixture) -> None:
    broker = Condition(logging.getLogger("test.kafka"), "kafka", "cannot reach the Kafka brokers")
    client_log = _ClientLog(broker)
    fail = "[thrd:b:1/bootstrap]: b:1/bootstrap: Connect to ipv4#127.0.0.1:1 failed: Connection refused"
    with caplog.at_level(logging.DEBUG):
        for _ in range(50):
            client_log.log(logging.ERROR, "%s [%s] %s", "FAIL", "rdkafka#producer-1", fail)
        client_log.log(logging.INFO, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "something else")
    assert broker.active and broker.attempts == 50
    lines = [r.getMessage() for r in caplog.records]
    assert len([line for line in lines if "Connection refused" in line]) == 1  # one line, not fifty
    assert any("something else" in line for line in lines)  # other lines pass through
