"""Kafka sink: confluent-kafka's idempotent producer with ``acks=all``.

An event counts as delivered only when its delivery report arrives without
error. Per-partition order on the broker is kept by the idempotent producer
(its retries never reorder), so the relay may keep many messages in flight.

The sink owns the delivery deadline, not librdkafka: ``message.timeout.ms`` is 0
(never), as librdkafka times a queued message out alone and goes on with the later
ones of its partition, which would let a key's next event land ahead of it. When
the oldest message without a report passes the deadline, the producer counts as
lost and the relay replaces it: everything unreported fails together, always the
tail of each key's events in flight, and is sent again in order. A message the
broker refused for good keeps its own error through that.
Errors are classified once, here: refused for good -> :class:`Dead`, a fatal
producer error -> the sink reports itself unhealthy and the relay recreates it,
anything else -> :class:`Retry`. The error kind is librdkafka's error name.

Delivery reports are served on a thread of the sink's own, which waits in librdkafka's poll with
the GIL released: the relay's loop never waits in a poll slice of the client's. A delivery of a
batch sent whole (``produce_many``) is stored straight into its slot there; every other report
is queued for :meth:`KafkaSink.poll`, which the relay's loop calls, and :attr:`KafkaSink.wake`
is set when there are new ones (the relay waits on it, with NOTIFY and its other news).
``send_now`` asks that thread to flush (librdkafka's only way past the linger) and returns.

A broker outage is one :class:`~outbox.observe.conditions.Condition`: librdkafka's
connection failures (its log lines and error callbacks, several per second
per broker while it is down) become one line when it starts, a summary a
minute, and one line when a delivery succeeds again.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from itertools import repeat
from operator import length_hint
from typing import Any

from confluent_kafka import KafkaError, KafkaException

# The C producer itself, not confluent_kafka.Producer: an OpenTelemetry
# auto-instrumentation replaces that name with a wrapper that injects its own
# traceparent header, which would overwrite the one the event was written with.
from confluent_kafka.cimpl import Producer

from outbox.events import HEADERS_OF, KEY_OF, PAYLOAD_OF, TOPIC_OF, ClaimedEvent
from outbox.observe.conditions import Condition
from outbox.sinks.base import Dead, Delivered, Outcome, OutcomeSlots, Report, Retry, Settle
from outbox.sinks.kafka_config import build_config

log = logging.getLogger("outbox.kafka")

# Errors that no retry can fix: the message or its destination is refused.
PERMANENT_ERRORS = frozenset(
    {
        KafkaError.MSG_SIZE_TOO_LARGE,
        KafkaError.RECORD_LIST_TOO_LARGE,
        KafkaError.TOPIC_EXCEPTION,  # invalid topic name
        KafkaError.TOPIC_AUTHORIZATION_FAILED,
        KafkaError.CLUSTER_AUTHORIZATION_FAILED,
        KafkaError.INVALID_RECORD,
        KafkaError.INVALID_REQUIRED_ACKS,
        KafkaError.UNKNOWN_TOPIC_OR_PART,  # reported only after metadata propagation timed out
        KafkaError._UNKNOWN_TOPIC,
        KafkaError._INVALID_ARG,
    }
)

UNASSIGNED = -1  # librdkafka's RD_KAFKA_PARTITION_UA: the partitioner picks by key
BUFFER_FULL_WAIT = 0.005  # seconds between tries while the client's queue is full
SEND_NOW_WAIT = 0.005  # seconds a flush that send_now() asks for may last (it ends at the ack)
# Seconds the report thread waits in librdkafka's poll at a time while messages are out: a flush
# that send_now() asks for meanwhile starts within this.
REPORT_SLICE = 0.001
IDLE_WAIT = 0.5  # seconds the report thread sleeps with nothing out (then serves client errors)
PROBE_TIMEOUT = 0.5  # seconds a metadata request may take when probing brokers counted down


def classify(err: KafkaError) -> Retry | Dead:
    """The outcome a failed produce or delivery report stands for; its kind is the error's name."""
    kind = err.name()
    reason = f"{kind}: {err.str()}"
    if err.code() in PERMANENT_ERRORS:
        return Dead(kind, reason)
    return Retry(kind, reason)


# librdkafka log facilities that report a broker connection failing.
CONNECTION_FACILITIES = frozenset({"FAIL", "ERROR", "BROKERFAIL", "CONNECT"})
# Error callback codes that mean "cannot reach the brokers" (not a fatal error).
CONNECTION_ERRORS = frozenset({KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE})
# Errors after which this producer can deliver nothing more, fatal or not to librdkafka: its
# id or epoch is no longer the broker's (after a long network freeze a broker may answer every
# retry with PRODUCER_FENCED). The producer is replaced at once rather than when the stuck
# detector notices no delivery for STUCK_MIN seconds.
PRODUCER_LOST = frozenset(
    {
        KafkaError.PRODUCER_FENCED,
        KafkaError.INVALID_PRODUCER_EPOCH,
        KafkaError.UNKNOWN_PRODUCER_ID,
        KafkaError._FENCED,
    }
)
# The retry kind of an event whose producer was lost: a failure of the sink's client, not of the
# event; retried at once when the sinks answer again (sinks.base.UNREACHABLE_KINDS).
PRODUCER_FAILED = "producer_failed"


def producer_lost(err: KafkaError) -> bool:
    """Whether the producer that reported ``err`` must be replaced."""
    return bool(err.fatal()) or err.code() in PRODUCER_LOST


class _ClientLog(logging.Logger):
    """librdkafka's log lines: connection failures feed the broker condition, the rest pass through.

    confluent-kafka calls ``log(level, "%s [%s] %s", facility, client, message)``
    from ``poll()``, on the relay's thread.
    """

    def __init__(self, broker: Condition) -> None:
        super().__init__("outbox.librdkafka")
        self._broker = broker
        self._out = logging.getLogger("outbox.librdkafka")

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if len(args) == 3 and args[0] in CONNECTION_FACILITIES and level >= logging.WARNING:
            self._broker.fail(str(args[2]))
            return
        if len(args) == 3 and args[0] == "CONFWARN" and "enable.gapless.guarantee" in str(args[2]):
            return  # "is experimental": set on purpose, said each time a producer is made
        self._out.log(level, msg, *args, **kwargs)


# One outage condition per cluster, shared by every producer the relay makes for it:
# a producer replaced during an outage must not lose the outage's end line.
_BROKERS: dict[str, Condition] = {}


def broker_condition(bootstrap: str) -> Condition:
    """The "cannot reach the Kafka brokers" condition of the cluster at ``bootstrap``."""
    return _BROKERS.setdefault(bootstrap, Condition(log, "kafka", "cannot reach the Kafka brokers"))


# tuple.__new__ directly: Delivered's own __new__ is one more Python call per delivered event.
_new_delivered: Callable[[type[Delivered], tuple[Any, ...]], Delivered] = tuple.__new__

LEGAL_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")  # Kafka's own rule for topic names


def _legal_topic(topic: str) -> bool:
    return LEGAL_TOPIC.fullmatch(topic) is not None and topic not in (".", "..")


STUCK_FACTOR = 3.0  # delivery timeouts without one success before the producer is recreated
STUCK_MIN = 5.0  # seconds, at least


def produce_each(
    produce: Callable[..., None],
    topics: Sequence[str],
    payloads: Iterable[bytes],
    keys: Iterable[bytes | None],
    reports: Iterable[Callable[[KafkaError | None, Any], None]],
    headers: Iterable[Any],
) -> int:
    """Queue one message per topic with ``produce`` (a producer's), until one is not taken;
    returns how many were queued.

    The client's ``produce()`` runs in one C-level loop (``map``), so no Python runs between
    two messages: a batch is queued in about a microsecond per event, inside one ``linger.ms``
    window. Queued message by message with Python in between, the linger expires while the
    batch is still being queued, and librdkafka's broker thread then wakes up about once per
    message (decision 0013)."""
    pending = iter(topics)
    try:
        deque(
            map(
                produce,
                pending,
                payloads,
                keys,
                repeat(UNASSIGNED),
                reports,
                repeat(None),
                repeat(0),
                headers,
            ),
            maxlen=0,
        )
    except (BufferError, KafkaException, TypeError, ValueError):
        # map() took the failing message's arguments before the call that raised.
        return len(topics) - 1 - length_hint(pending)
    return len(topics)


class KafkaSink:
    """Publishes events with one idempotent producer."""

    def __init__(
        self,
        bootstrap: str,
        config: Mapping[str, Any] | None = None,
        *,
        delivery_timeout: float = 15.0,
    ) -> None:
        self.config = build_config(bootstrap, config, delivery_timeout)
        self.name = f"kafka://{bootstrap}"
        self._fatal: str | None = None
        # A producer can be stuck without a fatal error: a broker that lost its
        # state (restarted empty, or expired our producer id) answers
        # UNKNOWN_PRODUCER_ID to every epoch librdkafka bumps locally, and every
        # message times out for ever. No delivery for this long -> a new producer.
        self._stuck_after = max(STUCK_MIN, STUCK_FACTOR * delivery_timeout)
        self._deadline = delivery_timeout
        # Each produce call's messages as [monotonic time, reports still to come], oldest first:
        # the head is the oldest message without a report (healthy() holds it to the deadline).
        self._sent: deque[list[float]] = deque()
        self._deadline_lock = threading.Lock()  # healthy() runs on the loop's and /readyz's threads
        self._topics_ok: set[str] = set()
        self._failing_since = 0.0  # monotonic time of the first failure since the last success
        self._last_failure = ""
        self.broker = broker_condition(bootstrap)
        # librdkafka's own log lines go through Python logging, not raw stderr.
        self._producer = Producer(
            {**self.config, "error_cb": self._on_error, "logger": _ClientLog(self.broker)}
        )
        # Reports for the loop's thread (poll), and deliveries stored straight into their slots:
        # both written by the report thread only, read by the loop's.
        self.wake = threading.Event()  # set when reports are ready (Signals; a Router shares one)
        self._posted: deque[tuple[Report, Outcome]] = deque()
        self._stored = 0
        self._stored_seen = 0  # loop thread
        self._work = threading.Event()  # messages to serve, or a flush asked: wakes the report thread
        self._produced = False  # something was queued since the report thread was last woken
        self._flush_asked = False
        self._closing = False
        self._reporter = threading.Thread(
            target=self._serve_reports, name="outbox-kafka-reports", daemon=True
        )
        self._reporter.start()

    # -- the report thread --------------------------------------------------------------

    def _serve_reports(self) -> None:
        """Serve delivery reports (and the client's errors and log lines) until closed: flush when
        asked, poll in slices while messages are out, else sleep until something is produced."""
        producer = self._producer
        while not self._closing:
            try:
                if self._flush_asked:
                    self._flush_asked = False
                    producer.flush(SEND_NOW_WAIT)
                elif len(producer):
                    producer.poll(REPORT_SLICE)
                else:
                    self._work.clear()  # first: a produce or a flush asked after this sets it again
                    if not self._flush_asked and not len(producer):
                        self._work.wait(IDLE_WAIT)
                    producer.poll(0)
            except KafkaException as exc:  # a fatal error surfaces here too (e.g. UNKNOWN_PRODUCER_ID)
                self._raised(exc)
            if (self._posted or self._stored != self._stored_seen) and not self.wake.is_set():
                self.wake.set()

    def _post(self, report: Report, outcome: Outcome) -> None:
        """A report for the loop's thread (report thread)."""
        self._posted.append((report, outcome))

    def _on_error(self, err: KafkaError) -> None:
        if producer_lost(err):
            self._lose(err)
        elif err.code() in CONNECTION_ERRORS:
            self.broker.fail(f"{err.name()}: {err.str()}")
        else:
            log.warning("kafka client error: %s: %s", err.name(), err.str())

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        if self._fatal is not None:
            return Retry(PRODUCER_FAILED, f"producer failed: {self._fatal}")
        if event.topic not in self._topics_ok:
            # A name Kafka can never accept is refused here, at the first attempt,
            # not after a metadata round trip that may time out under load.
            if not _legal_topic(event.topic):
                return Dead(
                    "invalid_topic",
                    f"invalid topic name {event.topic!r}: Kafka allows 1-249 of [a-zA-Z0-9._-]",
                )
            self._topics_ok.add(event.topic)
        # partial (C) rather than a closure per message: this is the hot path. [sent at, messages,
        # reports]: the loop's thread writes the first two, the report thread the third.
        sent = [time.monotonic(), 1.0, 0.0]
        on_delivery = partial(self._on_delivery, sent, report)
        while True:
            try:
                # Positional: confluent-kafka parses keyword arguments by name on every call
                # (decision 0013). Its order: topic, value, key, partition, callback,
                # on_delivery (an alias), timestamp, headers.
                self._producer.produce(
                    event.topic, event.payload, event.key, UNASSIGNED, on_delivery, None, 0, event.headers
                )
                self._sent.append(sent)
                self._produced = True
                return None
            except BufferError:
                # The client's queue is full: the report thread serves reports; try again.
                self._work.set()
                time.sleep(BUFFER_FULL_WAIT)
            except KafkaException as exc:
                if exc.args[0].fatal():
                    self._raised(exc)
                    return Retry(PRODUCER_FAILED, f"producer failed: {self._fatal}")
                return classify(exc.args[0])
            except (TypeError, ValueError) as exc:
                return Dead("client_rejected", f"rejected by the Kafka client: {exc}")

    def produce_many(self, events: Sequence[ClaimedEvent], outcomes: OutcomeSlots, settle: Settle) -> int:
        """Queue ``events`` in order, as :meth:`produce` would, until one is not taken as it is;
        returns how many were queued (``len(events)`` in the common case).

        Event ``i``'s delivery is stored straight into ``outcomes[i]``; any other outcome goes
        to ``settle(i, outcome)``. One Python call per delivery report, not two (decision 0013).

        The batch is queued by :func:`produce_each`, in one C-level loop. It stops before the
        first event the client refuses (or when its queue is full): the caller goes on event by
        event from there, so that a refused event's key can hold that key's later events. With
        the producer failed, or an illegal topic name in the batch, it queues nothing.
        """
        if self._fatal is not None:
            return 0
        topics = list(map(TOPIC_OF, events))
        new = set(topics).difference(self._topics_ok)
        if new:
            if not all(map(_legal_topic, new)):
                return 0  # produce() refuses the illegal name, event by event
            self._topics_ok.update(new)
        sent = [time.monotonic(), 0.0, 0.0]
        report = partial(self._on_delivery_at, sent, outcomes, settle)
        queued = produce_each(
            self._producer.produce,
            topics,
            map(PAYLOAD_OF, events),
            map(KEY_OF, events),
            map(partial, repeat(report), range(len(events))),
            map(HEADERS_OF, events),
        )
        if queued:
            sent[1] = queued
            self._sent.append(sent)
            self._produced = True
        return queued

    def _on_delivery_at(
        self,
        sent: list[float],
        outcomes: OutcomeSlots,
        settle: Settle,
        index: int,
        err: KafkaError | None,
        msg: Any,
    ) -> None:
        """A delivery report of :meth:`produce_many` (report thread): a delivery is stored in its
        slot there and then, in one call; anything else goes to the loop's thread."""
        sent[2] += 1
        if err is None:
            if self._failing_since:
                self._failing_since = 0.0
            if self.broker.since is not None:
                self.broker.ok()
            outcomes[index] = _new_delivered(Delivered, (msg.partition(), msg.offset(), None))
            self._stored += 1
        else:
            self._post(partial(settle, index), self._failed(err))

    def _on_delivery(self, sent: list[float], report: Report, err: KafkaError | None, msg: Any) -> None:
        """A delivery report of :meth:`produce` (report thread): for the loop's thread."""
        sent[2] += 1
        if err is None:
            self._failing_since = 0.0
            if self.broker.since is not None:
                self.broker.ok()
            self._post(report, _new_delivered(Delivered, (msg.partition(), msg.offset(), None)))
        else:
            self._post(report, self._failed(err))

    def _failed(self, err: KafkaError) -> Outcome:
        """The outcome of a delivery report with an error."""
        outcome = classify(err)
        lost = producer_lost(err)
        if isinstance(outcome, Dead) and not lost:
            # Refused for good: its own error, also when the producer is lost (a retry would meet
            # it again with every replacement).
            return outcome
        if lost or self._fatal is not None:
            # A lost producer's reports, its purged messages' included, all say the same: retried
            # as soon as its replacement answers, not after a backoff.
            self._lose(err)
            return Retry(PRODUCER_FAILED, f"producer failed: {self._fatal}")
        assert isinstance(outcome, Retry)
        if not self._failing_since:
            self._failing_since = time.monotonic()
        self._last_failure = outcome.reason
        return outcome

    def poll(self, timeout: float) -> int:
        """Serve the reports the report thread queued (waiting at most ``timeout`` for one);
        how many reports came in since the last call, deliveries stored in their slots included.
        It also wakes the report thread for what was produced since (only then: each wake-up is
        a thread switch, and the loop polls at every step)."""
        if self._produced:
            self._produced = False
            self._work.set()
        if timeout > 0:
            if not self._posted and self._stored == self._stored_seen:
                self.wake.wait(timeout)
            # Before serving: a report queued after this sets it again. With timeout 0 a Router or
            # the relay is polling (either clears its shared wake-up itself, before it looks).
            self.wake.clear()
        return self._serve()

    def _serve(self) -> int:
        posted = self._posted
        served = 0
        while posted:
            report, outcome = posted.popleft()
            report(outcome)
            served += 1
        stored = self._stored
        served += stored - self._stored_seen
        self._stored_seen = stored
        return served

    def send_now(self) -> None:
        """Send what is queued without waiting out ``linger.ms`` (the relay calls this after a
        batch that was not full: no backlog behind it to batch with, so waiting only adds latency).

        librdkafka has no call for this but ``flush()``, which makes every broker thread treat
        the linger as expired while it runs: the report thread runs it, for :data:`SEND_NOW_WAIT`
        at most (long enough for the broker threads to wake), and this returns at once.
        """
        self._flush_asked = True
        self._work.set()

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` for every report, serving them; how many messages are still out."""
        deadline = time.monotonic() + timeout
        while True:
            if not self._reporter.is_alive():  # closed: this thread serves them
                try:
                    self._producer.flush(max(0.0, deadline - time.monotonic()))
                except KafkaException as exc:
                    self._raised(exc)
                self._serve()
                return len(self._producer)
            left = len(self._producer)  # read first: its reports are queued before it reaches 0
            self._serve()
            if not left or time.monotonic() >= deadline:
                return left
            self.send_now()
            time.sleep(min(REPORT_SLICE, max(0.0, deadline - time.monotonic())))

    def _raised(self, exc: KafkaException) -> None:
        err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
        if err is None:
            self._fatal = self._fatal or str(exc)
            log.error("kafka producer fatal error: %s", self._fatal, extra={"event": "kafka.fatal"})
        elif producer_lost(err):
            self._lose(err)
        else:
            log.warning("kafka client error: %s: %s", err.name(), err.str())

    def _lose(self, err: KafkaError) -> None:
        """This producer can deliver nothing more: healthy() says so and the relay replaces it
        at its next step. Logged once per producer (a fenced one answers every retry so)."""
        if self._fatal is None:
            self._fatal = f"{err.name()}: {err.str()}"
            log.error("kafka producer lost, replacing it: %s", self._fatal, extra={"event": "kafka.lost"})

    def probe(self) -> None:
        """While the brokers count as unreachable, ask one for metadata (at most
        PROBE_TIMEOUT): an answer ends the outage before any event is due again."""
        if not self.broker.active or self._fatal is not None:
            return
        try:
            self._producer.list_topics(timeout=PROBE_TIMEOUT)
        except KafkaException:
            return
        self.broker.ok()

    def trouble(self) -> str | None:
        """Why the sink cannot deliver now, or None (for /readyz)."""
        if self._fatal is not None:
            return f"producer failed: {self._fatal}"
        b = self.broker
        return f"{b.description} for {b.seconds():.0f} s: {b.last_error}" if b.active else None

    def healthy(self) -> bool:
        """False once the producer can deliver nothing more: fatal, lost, stuck, or its oldest
        message without a report is past the deadline. The loop asks every step, /readyz too."""
        with self._deadline_lock:
            sent = self._sent
            while sent and sent[0][2] >= sent[0][1]:
                sent.popleft()
            if sent and self._fatal is None:
                waited = time.monotonic() - sent[0][0]
                if waited > self._deadline:
                    self._fatal = (
                        f"a message had no delivery report for {waited:.0f} s ({self._deadline:g} s allowed)"
                    )
                    log.warning("kafka producer past its deadline, replacing it: %s", self._fatal,
                                extra={"event": "kafka.deadline"})  # fmt: skip
        if self._fatal is None and self._failing_since:
            failing = time.monotonic() - self._failing_since
            if failing > self._stuck_after:
                self._fatal = f"no delivery succeeded for {failing:.0f} s (last: {self._last_failure})"
                log.warning("kafka producer looks stuck: %s", self._fatal, extra={"event": "kafka.stuck"})
        return self._fatal is None

    def close(self, timeout: float) -> None:
        """Stop the report thread, then flush within ``timeout`` on this thread."""
        self._closing = True
        self._work.set()
        self._reporter.join()
        remaining = self.flush(timeout)
        if remaining:
            log.warning("closing kafka producer with %d messages unacknowledged", remaining)
            self._producer.purge()
            try:
                self._producer.poll(0)
            except KafkaException as exc:
                self._raised(exc)
            self._serve()
