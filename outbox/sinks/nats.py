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

import asyncio
import logging
from functools import partial
from typing import Any

import nats
import nats.errors
import nats.js.errors

from outbox.sinks.aio import TIMEOUT, UNAVAILABLE, AsyncSink, Item, Refused, cancel_unfinished, text_headers
from outbox.sinks.base import Dead, Delivered, Outcome, Report, Retry

log = logging.getLogger("outbox.sinks")

LOST = (nats.errors.ConnectionClosedError, nats.errors.StaleConnectionError, ConnectionError)
MAX_PENDING = 20000  # async publishes awaiting their ack, at most (the relay's own cap is lower)


class NatsSink(AsyncSink):
    scheme = "nats"
    system = "nats"
    default_port = 4222

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

    def dispatch(self, items: list[Item]) -> None:
        # One task per burst, not per event: publish_async only writes to the connection's
        # buffer; each PubAck settles its event through a callback on its future.
        self._loop.create_task(self._burst(items))

    async def _burst(self, items: list[Item]) -> None:
        try:
            js = await self.client()
        except Exception as exc:
            outcome = self.failure(exc)
            self.done_many((report, outcome) for _, report in items)
            return
        acks: list[asyncio.Future[Any]] = []
        for event, report in items:
            try:
                headers = text_headers(event)
                headers["Nats-Msg-Id"] = event.event_id
                if len(event.payload) > js._nc.max_payload:
                    raise Refused(
                        "message_too_large",
                        f"{len(event.payload)} bytes is larger than the server's max_payload "
                        f"{js._nc.max_payload}",
                    )
                ack = await js.publish_async(event.topic, event.payload, headers=headers)
            except Exception as exc:
                self.done(report, self._failed(exc, js, event.topic))
                continue
            ack.add_done_callback(partial(self._acked, report, js, event.topic))
            acks.append(ack)
        if acks:
            self._loop.call_later(self.timeout, cancel_unfinished, acks)

    def _acked(self, report: Report, js: Any, topic: str, ack: asyncio.Future[Any]) -> None:
        if ack.cancelled():
            outcome: Outcome = Retry(TIMEOUT, f"{self.name} did not acknowledge within {self.timeout:g} s")
        elif (exc := ack.exception()) is not None:
            outcome = self._failed(exc, js, topic)
        else:
            result = ack.result()
            self.confirmed()
            outcome = Delivered(None, result.seq, result.stream)
        self.done(report, outcome)

    def _failed(self, exc: BaseException, js: Any, topic: str) -> Outcome:
        """The outcome of a publish that failed with ``exc``."""
        if isinstance(exc, nats.js.errors.NoStreamResponseError):
            return Retry("no_stream", f"no JetStream stream of {self.name} takes subject {topic!r}")
        if isinstance(exc, nats.js.errors.APIError):
            return self._api_error(exc)
        if isinstance(exc, nats.errors.BadSubjectError):
            return Dead("invalid_subject", f"{topic!r} is not a valid NATS subject")
        if isinstance(exc, nats.errors.MaxPayloadError):
            return Dead("message_too_large", f"{self.name}: {self.clean(exc)}")
        if isinstance(
            exc, (nats.errors.ConnectionClosedError, nats.errors.StaleConnectionError, ConnectionError)
        ):
            if js is self._conn:
                self.lost(f"connection lost: {self.clean(exc)}")
            return Retry(UNAVAILABLE, f"cannot reach {self.name}: {self.clean(exc)}")
        return self.failure(exc) if isinstance(exc, Exception) else Retry(type(exc).__name__, str(exc))

    def _api_error(self, exc: Any) -> Outcome:
        code = exc.err_code or exc.code or 0
        text = f"{self.name}: JetStream error {code}: {exc.description}"
        # 10054: maximum message size exceeded; 10039/10041 (and 400 codes): malformed for the stream.
        if exc.code in (400, 413) or exc.err_code in (10054,):
            return Dead(f"jetstream_{code}", text)
        return Retry(f"jetstream_{code}", text)
