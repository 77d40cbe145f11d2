"""outbox.sinks.kafka: error classification and producer configuration (pure)."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from outbox.errors import ConfigError
from outbox.observe.conditions import Condition
from outbox.sinks.base import Dead, Retry
from outbox.sinks.kafka import _ClientLog, classify
from outbox.sinks.kafka_config import build_config, redacted


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
    assert "s3cret" not in str(redacted(config))
    with pytest.raises(ConfigError, match=r"enable\.idempotence"):
        build_config("b:9092", {"enable.idempotence": "false"}, 15.0)
    with pytest.raises(ConfigError, match="acks"):
        build_config("b:9092", {"acks": "1"}, 15.0)
    with pytest.raises(ConfigError, match=r"enable\.gapless\.guarantee"):
        build_config("b:9092", {"enable.gapless.guarantee": "false"}, 15.0)


def test_librdkafka_never_times_a_message_out_the_sink_does() -> None:
    """librdkafka times a message out alone and sends the later ones of its partition (a key's
    next event would land first): it never does here, and a setting that would is refused in
    one line naming it."""
    config = build_config("b:9092", None, 15.0)
    assert config["message.timeout.ms"] == 0 and config["enable.gapless.guarantee"] == "true"
    assert build_config("b:9092", {"message.timeout.ms": "0"}, 15.0)["message.timeout.ms"] == 0
    for key in ("message.timeout.ms", "delivery.timeout.ms"):
        with pytest.raises(ConfigError) as raised:
            build_config("b:9092", {key: 5000}, 15.0)
        said = str(raised.value)
        assert said.startswith(f"kafka config {key}: must be 0") and "OUTBOX_DELIVERY_TIMEOUT" in said
        assert "\n" not in said


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


@pytest.mark.parametrize(
    "code",
    [
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError._FENCED,
    ],
)
def test_a_fenced_producer_is_unhealthy_at_once_and_its_events_retry_as_unreachable(
    code: int, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer fenced after a network freeze answers every retry with PRODUCER_FENCED (not
    fatal to librdkafka for an idempotent producer): it is given up at the first such report,
    not STUCK_MIN seconds later, once in the log, and the event waits for the new producer."""
    from outbox.sinks.base import UNREACHABLE_KINDS
    from outbox.sinks.kafka import KafkaSink

    sink = KafkaSink("127.0.0.1:9", delivery_timeout=5.0)  # no broker is contacted here
    try:
        assert sink.healthy()
        reports: list[object] = []
        for _ in range(3):
            sink._on_delivery([0.0, 1.0, 0.0], reports.append, KafkaError(code), None)
        assert not reports, "a report reaches the relay only through poll(), on its own thread"
        assert sink.poll(0) == 3
        assert not sink.healthy() and "producer failed" in (sink.trouble() or "")
        assert all(isinstance(r, Retry) and r.kind in UNREACHABLE_KINDS for r in reports), reports
        assert len([r for r in caplog.records if "producer lost" in r.getMessage()]) == 1
    finally:
        sink._producer.purge()
        sink.close(0)


def test_an_ordinary_retry_keeps_the_producer() -> None:
    from outbox.sinks.kafka import KafkaSink

    sink = KafkaSink("127.0.0.1:9", delivery_timeout=5.0)
    reports: list[object] = []
    try:
        sink._on_delivery([0.0, 1.0, 0.0], reports.append, KafkaError(KafkaError._MSG_TIMED_OUT), None)
        sink.poll(0)
        assert sink.healthy() and isinstance(reports[0], Retry)
    finally:
        sink.close(0)


def test_a_refusal_for_good_keeps_its_own_error_through_a_lost_producer() -> None:
    """A message the broker refused for good, reported while (or after) the producer was lost,
    is dead with its own error: reported as the producer's failure, it would be retried on every
    replacement for ever."""
    from outbox.sinks.kafka import KafkaSink

    sink = KafkaSink("127.0.0.1:9", delivery_timeout=5.0)
    try:
        reports: list[object] = []
        sink._on_delivery([0.0, 1.0, 0.0], reports.append, KafkaError(KafkaError.PRODUCER_FENCED), None)
        sink._on_delivery([0.0, 1.0, 0.0], reports.append, KafkaError(KafkaError.MSG_SIZE_TOO_LARGE), None)
        sink._on_delivery([0.0, 1.0, 0.0], reports.append, KafkaError(KafkaError._PURGE_QUEUE), None)
        sink.poll(0)
        fenced, refused, purged = reports
        assert isinstance(fenced, Retry) and fenced.kind == "producer_failed"
        assert isinstance(refused, Dead) and refused.kind == "MSG_SIZE_TOO_LARGE"
        assert isinstance(purged, Retry) and purged.kind == "producer_failed"
    finally:
        sink._producer.purge()
        sink.close(0)
