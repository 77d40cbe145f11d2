"""NATS JetStream sink: ``nats://host:port`` (``outbox[nats]``).

Client: nats-py, the NATS maintainers' asyncio client. Publishes use its
asynchronous JetStream publish (``publish_async``): many messages in flight on
one connection, each acknowledged by the stream (a PubAck) on its own reply.

- Subject: the event's topic. Body: the payload bytes.
- Headers: the event's headers + ``event-id`` + ``event-key`` (the key, absent
  when null) + ``Nats-Msg-Id`` = event id, so
  the stream's duplicate window drops a redelivery.
- Delivered only on the PubAck; the archive keeps the stream (``sink_ref``) and
  its sequence (``sink_offset``).
- No stream takes the subject (503 no responders) -> retried, saying so.
  Streams are the operator's to create (``nats stream add``): the relay never
  creates one, since their retention, replicas and limits are policy.

NATS headers are text. A header value that is not UTF-8, or holds a line
break, cannot be sent as it is: such an event is dead-lettered
(``invalid_header``, naming the header) rather than altered silently.
"""

from __future__ import annotations

import logging
from typing import Any

import nats
import nats.errors
import nats.js.errors

from outbox.events import ClaimedEvent
from outbox.sinks.aio import AsyncSink, Refused, Unavailable, text_headers
from outbox.sinks.base import Delivered, Outcome, Retry

log = logging.getLogger("outbox.sinks")

MAX_PENDING = 20000  # async publishes awaiting their ack, at most (the relay's own cap is lower)


class NatsSink(AsyncSink):
    scheme = "nats"
    system = "nats"

    async def connect(self) -> Any:
        async def quiet(_: Exception) -> None:  # errors reach us through the failed sends
            return None

        opened: list[Any] = []

        async def closed() -> None:
            if opened and self._conn is opened[0]:
                self.lost("connection closed")

        nc = await nats.connect(
            self.url.text,
            allow_reconnect=False,  # this sink reconnects, with its own backoff and outage log
            connect_timeout=max(1, int(self.timeout)),
            error_cb=quiet,
            disconnected_cb=closed,
            max_reconnect_attempts=0,
        )
        js = nc.jetstream(timeout=self.timeout, publish_async_max_pending=MAX_PENDING)
        opened.append(js)
        return js

    async def disconnect(self, conn: Any) -> None:
        await conn._nc.close()

    async def deliver(self, event: ClaimedEvent) -> Outcome:
        headers = text_headers(event)
        headers["Nats-Msg-Id"] = event.event_id
        js = await self.client()
        nc = js._nc
        if len(event.payload) > nc.max_payload:
            raise Refused(
                "message_too_large",
                f"{len(event.payload)} bytes is larger than the server's max_payload {nc.max_payload}",
            )
        try:
            future = await js.publish_async(event.topic, event.payload, headers=headers)
            ack = await future
        except nats.js.errors.NoStreamResponseError:
            return Retry("no_stream", f"no JetStream stream of {self.name} takes subject {event.topic!r}")
        except nats.js.errors.APIError as exc:
            return self._api_error(exc)
        except nats.errors.BadSubjectError:
            raise Refused("invalid_subject", f"{event.topic!r} is not a valid NATS subject") from None
        except nats.errors.MaxPayloadError as exc:
            raise Refused("message_too_large", f"{self.name}: {self.clean(exc)}") from None
        except (nats.errors.ConnectionClosedError, nats.errors.StaleConnectionError, ConnectionError) as exc:
            if js is self._conn:
                self.lost(f"connection lost: {self.clean(exc)}")
            raise Unavailable(f"{self.name}: {self.clean(exc)}") from None
        self.confirmed()
        return Delivered(None, ack.seq, ack.stream)

    def _api_error(self, exc: Any) -> Outcome:
        code = exc.err_code or exc.code or 0
        text = f"{self.name}: JetStream error {code}: {exc.description}"
        # 10054: maximum message size exceeded; 10039/10041 (and 400 codes): malformed for the stream.
        if exc.code in (400, 413) or exc.err_code in (10054,):
            raise Refused(f"jetstream_{code}", text)
        return Retry(f"jetstream_{code}", text)

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]:
        return f"send {topic}", {
            "messaging.system": "nats",
            "messaging.destination.name": topic,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "server.address": self.url.parts.hostname or "",
            "server.port": self.url.parts.port or 4222,
        }
