"""The consumer inbox: at-least-once delivery in, the handler's effect exactly once out.

The relay delivers at least once: after a crash between the broker's ack and the
archive's commit, an event is sent again, with the same ``event-id``. A consumer
that records each event id in the same database transaction as its handler's
effect sees every duplicate and skips it:

.. code-block:: python

    with conn.transaction():
        if outbox.inbox.first_delivery(conn, "billing", event_id):
            charge(conn, order)          # the effect, in the same transaction

- The record and the effect commit together or not at all: a handler that raises,
  or a process that dies, leaves no record, and the redelivery is handled.
- A concurrent delivery of the same event (a rebalance hands the partition to
  another consumer of the same name) waits on the first one's row: if that commits,
  the second is a duplicate; if it rolls back, the second is the first.
- Different consumer names see every event independently.

Where the guarantee ends: effects outside the consumer's database (an e-mail, a
call to another service) are not in the transaction. Make those idempotent with
the event id (an idempotency key), or put them in an outbox of their own.

Storage: ``<schema>.inbox`` (migration ``0005_inbox``). It may live in the
consumer's own database: ``outbox migrate --inbox-only`` creates just that. Old
rows go with ``outbox inbox prune --older-than 7d``; keep them longer than any
redelivery can take (the broker's retention of unconsumed messages, a replay).

:func:`consume_kafka` is the whole loop for Kafka. For the other sinks, the event
id is: RabbitMQ ``message_id`` (and header ``event-id``), NATS header
``Nats-Msg-Id`` / ``event-id``, Redis Streams field ``event-id``, webhooks header
``webhook-id``; ``docs/consumers.md`` has a recipe for each.
"""

from __future__ import annotations

import datetime as dt
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from outbox.errors import ConfigError, InvalidType, NotMigrated, UnsupportedConnection
from outbox.events import CLAIM_CHECK_HEADER, EVENT_ID_HEADER
from outbox.store.queries import query
from outbox.store.schema import DEFAULT_SCHEMA, schema_or_default
from outbox.write.stacks import AsyncWriter, Writer, _seen, async_writer_for, writer_for

log = logging.getLogger("outbox.inbox")

MAX_CONSUMER = 200  # characters of a consumer name
MAX_EVENT_ID = 255  # characters of an event id
PRUNE_CHUNK = 10_000  # rows deleted per transaction by prune


def _text(value: object, field: str, limit: int) -> str:
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{field}: not UTF-8 text") from None
    if not isinstance(value, str):
        raise InvalidType(f"{field}: expected str, bytes or UUID, got {type(value).__name__}")
    if not value:
        raise ConfigError(f"{field}: must not be empty")
    if len(value) > limit or "\x00" in value:
        raise ConfigError(f"{field}: at most {limit} characters, no NUL")
    return value


def _unknown_inbox(schema: str) -> NotMigrated:
    return NotMigrated(
        f"schema: {schema!r} holds no inbox table; run `outbox migrate --inbox-only --schema {schema}` "
        "on the consumer's database"
    )


def _as_inbox_error(exc: UnsupportedConnection) -> UnsupportedConnection:
    # The stacks' message names enqueue's twin; here the twin is first_delivery's.
    text = str(exc).replace("enqueue_async(...)", "first_delivery_async(...)")
    return UnsupportedConnection(text.replace("enqueue(...)", "first_delivery(...)"))


def first_delivery(
    conn: object, consumer: str, event_id: str | bytes | uuid.UUID, *, schema: str | None = None
) -> bool:
    """True the first time ``consumer`` sees ``event_id`` (and records it), False for a duplicate.

    Call it inside the consumer's own transaction, before the handler's effect, on any
    connection or session ``outbox.enqueue`` accepts. The record commits with the
    transaction or rolls back with it. ``event_id``: the message's ``event-id`` (str,
    its UTF-8 bytes as a Kafka header carries it, or a UUID).
    """
    schema = schema_or_default(schema)
    name = _text(consumer, "consumer", MAX_CONSUMER)
    key = _text(event_id, "event_id", MAX_EVENT_ID)
    try:
        writer: Writer = writer_for(conn)
    except UnsupportedConnection as exc:
        raise _as_inbox_error(exc) from None
    writer.require_transaction()
    seen = _seen(getattr(writer, "conn", conn))
    if "inbox:" + schema not in seen:
        if not writer.flag("inbox_table", schema, schema):
            raise _unknown_inbox(schema)
        seen.add("inbox:" + schema)
    return writer.flag("inbox_record", schema, name, key)


async def first_delivery_async(
    conn: object, consumer: str, event_id: str | bytes | uuid.UUID, *, schema: str | None = None
) -> bool:
    """:func:`first_delivery` on an async connection or session (psycopg, asyncpg, SQLAlchemy)."""
    schema = schema_or_default(schema)
    name = _text(consumer, "consumer", MAX_CONSUMER)
    key = _text(event_id, "event_id", MAX_EVENT_ID)
    try:
        writer: AsyncWriter = await async_writer_for(conn)
    except UnsupportedConnection as exc:
        raise _as_inbox_error(exc) from None
    writer.require_transaction()
    seen = _seen(getattr(writer, "conn", conn))
    if "inbox:" + schema not in seen:
        if not await writer.flag("inbox_table", schema, schema):
            raise _unknown_inbox(schema)
        seen.add("inbox:" + schema)
    return await writer.flag("inbox_record", schema, name, key)


def prune(
    conn: psycopg.Connection[Any],
    older_than: dt.timedelta,
    *,
    schema: str | None = None,
    chunk: int = PRUNE_CHUNK,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Delete inbox rows received more than ``older_than`` ago, ``chunk`` rows per transaction
    (writers are never blocked for long); return how many. ``conn`` must not be in a transaction."""
    schema = schema_or_default(schema)
    before = dt.datetime.now(dt.timezone.utc) - older_than
    statement = query("inbox_prune", schema)
    deleted = 0
    while True:
        with conn.transaction():
            n = conn.execute(statement, {"before": before, "chunk": chunk}).rowcount
        deleted += n
        if progress is not None:
            progress(deleted)
        if n < chunk:
            return deleted


def count_older(conn: psycopg.Connection[Any], older_than: dt.timedelta, *, schema: str | None = None) -> int:
    """How many inbox rows :func:`prune` would delete now."""
    schema = schema_or_default(schema)
    before = dt.datetime.now(dt.timezone.utc) - older_than
    row = conn.execute(query("inbox_count_before", schema), {"before": before}).fetchone()
    return int(row[0]) if row else 0


# -- the Kafka consumer loop -----------------------------------------------------------------


@dataclass(frozen=True)
class Delivery:
    """One Kafka message as the handler sees it."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    headers: Mapping[str, bytes | None]  # the last value of a repeated name
    event_id: str  # the event-id header; for a message without one, "topic/partition/offset"


Handler = Callable[[psycopg.Connection[Any], Delivery], None]


@dataclass
class ConsumeStats:
    """What :func:`consume_kafka` did, for the caller and its tests."""

    handled: int = 0  # handler ran and its transaction committed
    duplicates: int = 0  # already recorded: skipped, offset committed
    failures: int = 0  # handler raised (or the database failed): rolled back, tried again
    refused: int = 0  # a claim-check reference refused (malformed, or outside the store): skipped
    offsets: dict[tuple[str, int], int] = field(default_factory=dict)  # committed next offset


@contextmanager
def _stop_on_signals(stop: threading.Event, enabled: bool) -> Iterator[None]:
    """SIGTERM/SIGINT set ``stop`` (main thread only); the previous handlers come back after."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    for s in previous:
        signal.signal(s, lambda *_: stop.set())
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _delivery(msg: Any) -> Delivery:
    headers: dict[str, bytes | None] = {k: v for k, v in (msg.headers() or [])}
    raw = headers.get(EVENT_ID_HEADER)
    try:
        event_id = raw.decode("utf-8") if raw else ""
    except UnicodeDecodeError:
        event_id = ""
    if not event_id or len(event_id) > MAX_EVENT_ID:
        # Not from the relay: the message's own coordinates identify it.
        event_id = f"{msg.topic()}/{msg.partition()}/{msg.offset()}"
    return Delivery(
        msg.topic(), msg.partition(), msg.offset(), msg.key(), msg.value() or b"", headers, event_id
    )


def consume_kafka(
    config: Mapping[str, Any],
    topics: Sequence[str],
    handler: Handler,
    *,
    dsn: str,
    name: str | None = None,
    schema: str | None = None,
    stop: threading.Event | None = None,
    handle_signals: bool = True,
    poll_timeout: float = 0.5,
    retry_base: float = 0.5,
    retry_cap: float = 30.0,
    claim_check: Callable[[str], bytes] | None = None,
    claim_check_store: str | None = None,
) -> ConsumeStats:
    """Consume ``topics`` and call ``handler(conn, delivery)`` once per event, effectively.

    - ``config``: the confluent-kafka consumer settings (``bootstrap.servers``,
      ``group.id``, security …). Offsets are committed by this loop, never
      automatically: ``enable.auto.commit`` and ``enable.auto.offset.store`` are
      forced off.
    - ``name``: the inbox's consumer name [default: ``group.id``].
    - For each message, in one transaction on a connection to ``dsn``: record the
      event id in the inbox; on its first delivery run ``handler`` with that
      connection. Then, after the commit, commit the message's offset to Kafka.
      A crash in between redelivers a message whose record committed: it is
      skipped. A handler that raises rolls back and the message is tried again
      (backoff from ``retry_base`` doubling to ``retry_cap`` seconds); later
      messages of its partition wait, so per-partition order holds.
    - A message with an ``outbox-claim-check`` header gets its payload from the store
      before the handler sees it (``delivery.value``): ``claim_check(reference)``, by
      default :func:`outbox.sinks.claim_check.fetch` from ``claim_check_store`` only
      (``postgres:<schema>`` on ``dsn``, the default with this inbox's schema, or
      ``s3://bucket/prefix`` with boto3's settings). A store that cannot answer is a failure:
      retried. A reference that is malformed or points outside the store
      (:class:`~outbox.errors.ClaimCheckRefused`) fails that message alone: it is
      skipped, logged and counted (``refused``), and the consumer goes on.
    - Stops when ``stop`` is set or, in the main thread with ``handle_signals``, on
      SIGTERM/SIGINT: the message in hand finishes, the offsets are committed
      synchronously, the consumer leaves its group.
    """
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    settings = dict(config)
    if "group.id" not in settings:
        raise ConfigError("config: group.id is required (consumer offsets belong to a group)")
    settings["enable.auto.commit"] = False
    settings["enable.auto.offset.store"] = False
    consumer_name = _text(name if name is not None else str(settings["group.id"]), "name", MAX_CONSUMER)
    from outbox.errors import ClaimCheckRefused

    schema = schema_or_default(schema)
    if claim_check is None:
        from outbox.sinks.claim_check import fetch

        store = claim_check_store or f"postgres:{schema}"

        def claim_check(reference: str) -> bytes:
            return fetch(reference, store=store, dsn=dsn)

    stop = stop or threading.Event()
    stats = ConsumeStats()
    consumer = Consumer(settings)
    conn: psycopg.Connection[Any] | None = None
    failing_since = 0.0
    attempt = 0
    try:
        consumer.subscribe(list(topics))
        with _stop_on_signals(stop, handle_signals):
            while not stop.is_set():
                msg = consumer.poll(poll_timeout)
                if msg is None:
                    continue
                error = msg.error()
                if error is not None:
                    if error.fatal():
                        raise KafkaException(error)
                    log.debug("kafka: %s", error)  # librdkafka retries what is not fatal
                    continue
                delivery = _delivery(msg)
                try:
                    reference = delivery.headers.get(CLAIM_CHECK_HEADER)
                    if reference:
                        text = reference.decode("utf-8", "replace")  # not UTF-8: refused as malformed
                        delivery = replace(delivery, value=claim_check(text))
                    if conn is None or conn.closed:
                        # Not pinned (outbox.pinning): the consumer's DSN may be a transaction
                        # pooler's; the inbox's statements name pg_catalog's functions in full.
                        conn = psycopg.connect(dsn, autocommit=True)
                    with conn.transaction():
                        if first_delivery(conn, consumer_name, delivery.event_id, schema=schema):
                            handler(conn, delivery)
                            stats.handled += 1
                        else:
                            stats.duplicates += 1
                except ClaimCheckRefused as exc:  # this message's own, for good: the next one
                    stats.refused += 1
                    log.warning(
                        "consumer %s: %s at %s/%d/%d skipped: %s",
                        consumer_name,
                        delivery.event_id,
                        delivery.topic,
                        delivery.partition,
                        delivery.offset,
                        exc,
                    )
                except (NotMigrated, ConfigError):
                    raise
                except Exception as exc:  # the handler's, or the database's: rolled back
                    stats.failures += 1
                    attempt += 1
                    if conn is not None and (conn.closed or conn.broken):
                        conn.close()
                        conn = None
                    if not failing_since:
                        failing_since = time.monotonic()
                        log.warning(
                            "consumer %s: %s at %s/%d/%d failed, retrying it: %s: %s",
                            consumer_name,
                            delivery.event_id,
                            delivery.topic,
                            delivery.partition,
                            delivery.offset,
                            type(exc).__name__,
                            str(exc).splitlines()[0] if str(exc) else "",
                        )
                    # Back to this message: what the consumer fetched after it waits.
                    consumer.seek(TopicPartition(delivery.topic, delivery.partition, delivery.offset))
                    stop.wait(min(retry_cap, retry_base * 2 ** min(attempt - 1, 16)))
                    continue
                if failing_since:
                    log.info(
                        "consumer %s: %s handled after %d attempts (%.1fs)",
                        consumer_name,
                        delivery.event_id,
                        attempt + 1,
                        time.monotonic() - failing_since,
                    )
                    failing_since, attempt = 0.0, 0
                next_offset = TopicPartition(delivery.topic, delivery.partition, delivery.offset + 1)
                consumer.commit(offsets=[next_offset], asynchronous=True)
                stats.offsets[(delivery.topic, delivery.partition)] = delivery.offset + 1
        if stats.offsets:
            try:
                consumer.commit(
                    offsets=[TopicPartition(t, p, o) for (t, p), o in stats.offsets.items()],
                    asynchronous=False,
                )
            except KafkaException as exc:  # e.g. the partitions were revoked: redelivery is deduplicated
                log.warning("consumer %s: final offset commit failed: %s", consumer_name, exc)
    finally:
        consumer.close()
        if conn is not None:
            conn.close()
    return stats


def fetch_claim_check(
    reference: str | bytes,
    *,
    store: str = "postgres:" + DEFAULT_SCHEMA,
    dsn: str | None = None,
    endpoint: str | None = None,
) -> bytes:
    """The payload an ``outbox-claim-check`` header refers to, for a consumer that does not use
    :func:`consume_kafka`: from ``store`` only (``postgres:<schema>`` through ``dsn``, or
    ``s3://bucket[/prefix]`` with boto3's credentials, from ``endpoint``). Raises
    :class:`~outbox.errors.ClaimCheckRefused` for a reference that is malformed or points anywhere
    else, ``LookupError`` when it is gone (purged), :class:`~outbox.errors.StoreUnavailable`
    when the store cannot answer now."""
    from outbox.sinks.claim_check import fetch

    return fetch(reference, store=store, dsn=dsn, endpoint=endpoint)


__all__ = [
    "ConsumeStats",
    "Delivery",
    "consume_kafka",
    "count_older",
    "fetch_claim_check",
    "first_delivery",
    "prune",
]
