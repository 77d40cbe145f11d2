"""RabbitMQ sink: ``amqp://user:password@host:port/vhost?exchange=NAME`` (``outbox-relay[rabbitmq]``).

Client: aiormq, the asyncio AMQP 0-9-1 client under aio-pika, used directly: one
connection, one channel in publisher-confirm mode, many publishes in flight,
and RabbitMQ acknowledges them in batches (``multiple`` acks).

- Exchange NAME (default ``outbox``), type ``topic``, durable, declared when
  the sink connects (a no-op when it exists with the same type).
- Routing key: the event's topic. Body: the payload bytes.
- Properties: ``message_id`` = event id, ``delivery_mode`` 2 (persistent),
  ``content_type`` from the event's ``content-type`` header, and ``headers`` =
  the event's headers (text when UTF-8, else bytes) + ``event-id`` + ``event-key``
  (the key, absent when null).
- Published as mandatory: a message no queue takes comes back (basic.return)
  and is retried, with an error saying no queue is bound for its routing key.
- Delivered only on its confirm (basic.ack). A nack is retried.

Errors (docs/sinks.md has the table): larger than ``max_message_size`` (URL
option, default 128 MiB, RabbitMQ's default) -> dead ``message_too_large``,
refused before it is sent, since RabbitMQ would close the channel; the exchange
refused to this user (ACCESS_REFUSED) -> dead ``access_refused``; connection or
channel lost, login refused, exchange of another type -> retry.
"""

from __future__ import annotations

import logging
from typing import Any

import aiormq
from aiormq.abc import DeliveredMessage
from pamqp import commands as spec
from pamqp.common import FieldTable

from outbox.events import KEY_HEADER, ClaimedEvent
from outbox.sinks.aio import AsyncSink, Refused, Unavailable, as_bytes
from outbox.sinks.base import Delivered, Outcome, Retry
from outbox.sinks.routes import SinkURL

log = logging.getLogger("outbox.sinks")

DEFAULT_EXCHANGE = "outbox"
DEFAULT_MAX_MESSAGE_SIZE = 128 * 1024 * 1024  # bytes: RabbitMQ's default max_message_size
PERSISTENT = 2
NO_QUEUE = "no_queue_bound"


def header_value(value: str | bytes | None) -> str | bytearray:
    """An AMQP header value: text when the bytes are UTF-8, else a byte array."""
    raw = as_bytes(value)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return bytearray(raw)  # pamqp's type for a field-table byte array


class RabbitMQSink(AsyncSink):
    scheme = "amqp"
    system = "rabbitmq"
    default_port = 5672

    def __init__(self, url: SinkURL, *, timeout: float) -> None:
        options = url.options
        self.exchange = options.get("exchange", DEFAULT_EXCHANGE)
        self.max_size = int(options.get("max_message_size", DEFAULT_MAX_MESSAGE_SIZE))
        keep = [f"{k}={v}" for k, v in options.items() if k not in ("exchange", "max_message_size")]
        self._connect_url = url.parts._replace(query="&".join(keep)).geturl()
        super().__init__(url, timeout=timeout)

    async def connect(self) -> Any:
        connection = await aiormq.connect(self._connect_url)
        try:
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            await channel.exchange_declare(exchange=self.exchange, exchange_type="topic", durable=True)
        except BaseException:
            await connection.close()
            raise
        return channel

    async def disconnect(self, conn: Any) -> None:
        await conn.connection.close()

    async def deliver(self, event: ClaimedEvent) -> Outcome:
        if len(event.payload) > self.max_size:
            raise Refused(
                "message_too_large",
                f"{len(event.payload)} bytes is larger than max_message_size {self.max_size} of {self.name}",
            )
        headers: FieldTable = {name: header_value(value) for name, value in event.headers}
        if event.key is not None:
            headers[KEY_HEADER] = header_value(event.key)
        content_type = headers.get("content-type")
        properties = spec.Basic.Properties(
            message_id=event.event_id,
            delivery_mode=PERSISTENT,
            content_type=content_type if isinstance(content_type, str) else None,
            headers=headers,
        )
        channel = await self.client()
        try:
            confirm = await channel.basic_publish(
                event.payload,
                exchange=self.exchange,
                routing_key=event.topic,
                properties=properties,
                mandatory=True,
                # Not waiting for the frame to be written: with wait=True each publish holds
                # the channel lock until the socket took its frame, one publish at a time.
                # Delivered still means confirmed (the await returns the broker's confirm).
                wait=False,
            )
        except aiormq.exceptions.PublishError:
            return Retry(
                NO_QUEUE,
                f"no queue is bound to exchange {self.exchange!r} of {self.name} "
                f"for routing key {event.topic!r}",
            )
        except aiormq.exceptions.DeliveryError:
            return Retry("nacked", f"{self.name} nacked the message (an internal error of the broker)")
        except aiormq.exceptions.ChannelAccessRefused as exc:
            self.lost(f"channel closed: {self.clean(exc)}")
            raise Refused("access_refused", f"{self.name}: {self.clean(exc)}") from None
        except (
            aiormq.exceptions.AMQPError,
            aiormq.exceptions.ChannelInvalidStateError,
            ConnectionError,
        ) as exc:
            if channel is self._conn:
                self.lost(f"connection lost: {self.clean(exc)}")
            raise Unavailable(f"{self.name}: {self.clean(exc)}") from None
        if isinstance(confirm, DeliveredMessage) or not isinstance(confirm, spec.Basic.Ack):
            return Retry("nacked", f"{self.name} did not accept the message ({type(confirm).__name__})")
        self.confirmed()
        return Delivered()

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]:
        return f"send {self.exchange}", {
            "messaging.system": "rabbitmq",
            "messaging.destination.name": self.exchange,
            "messaging.rabbitmq.destination.routing_key": topic,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "server.address": self.url.parts.hostname or "",
            "server.port": self.url.parts.port or self.default_port,
        }
