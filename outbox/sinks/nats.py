"""NATS JetStream sink: ``nats://host:port`` (``outbox-relay[nats]``).

Client: nats-py, the NATS maintainers' asyncio client. A JetStream publish is
a core publish with a reply subject, which the stream answers with a PubAck:
the sink publishes each event with a reply subject of its own (one wildcard
subscription per connection takes them all), so many messages are in flight on
one connection and each is settled by its PubAck.

- Subject: the event's topic. Body: the payload bytes.
- Headers: the event's headers + ``event-id`` + ``event-key`` (the key, absent
  when null) + ``Nats-Msg-Id`` = event id, so
  the stream's duplicate window drops a redelivery (an event ``outbox verify --repair`` sent
  again, with its ``outbox-repair`` header, gets an id of its own).
- Delivered only on the PubAck; the archive keeps the stream (``sink_ref``) and
  its sequence (``sink_offset``).
- No stream takes the subject (503 no responders) -> retried, saying so.
  Streams are the operator's to create (``nats stream add``): the relay never
  creates one, since their retention, replicas and limits are policy.

NATS headers are text. A header value that is not UTF-8, or holds a line
break, cannot be sent as it is: such an event is dead-lettered
(``invalid_header``, naming the header) rather than altered silently.

Headers named ``Nats-*`` are the server's instructions (``Nats-Rollup`` purges a subject or
the stream, ``Nats-Expected-*`` and ``Nats-TTL`` change what it stores): they are the
relay's, never a writer's. An event that carries one is dead-lettered (``reserved_header``).
"""

from __future__ import annotations

import json
import logging
from functools import partial
from itertools import repeat
from typing import Any

import nats
import nats.errors

from outbox.events import REPAIR_HEADER
from outbox.sinks.aio import TIMEOUT, UNAVAILABLE, AsyncSink, Item, Refused, text_headers
from outbox.sinks.base import Dead, Delivered, Outcome, Report, Retry

log = logging.getLogger("outbox.sinks")

LOST = (nats.errors.ConnectionClosedError, nats.errors.StaleConnectionError, ConnectionError)
NO_RESPONDERS = "503"  # the status of the reply when no stream takes the subject
RESERVED_PREFIX = "nats-"  # header names the server acts on (compared in lower case)


def server_headers(headers: dict[str, str]) -> None:
    """Refused when an event's headers hold one the NATS server acts on (``Nats-*``)."""
    for name in headers:
        if name[:5].lower() == RESERVED_PREFIX:
            raise Refused(
                "reserved_header",
                f"header {name!r}: Nats-* headers instruct the NATS server; only the relay sets them",
            )


class Connection:
    """One NATS connection and the publishes awaiting their PubAck on it."""

    def __init__(self, nc: Any, prefix: str) -> None:
        self.nc = nc
        self.prefix = prefix  # reply subjects are prefix + a counter
        self.cut = len(prefix)
        self.acks: dict[str, tuple[Report, str]] = {}  # token -> (report, topic)
        self.sent = 0


class NatsSink(AsyncSink):
    scheme = "nats"
    system = "nats"
    default_port = 4222

    async def connect(self) -> Any:
        async def quiet(_: Exception) -> None:  # errors reach us through the failed sends
            return None

        opened: list[Connection] = []

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
        conn = Connection(nc, nc.new_inbox() + ".")
        try:
            await nc.subscribe(conn.prefix + "*", cb=partial(self._replied, conn))
        except BaseException:
            await nc.close()
            raise
        opened.append(conn)
        return conn

    async def disconnect(self, conn: Any) -> None:
        await conn.nc.close()

    def lost(self, why: str) -> None:
        conn = self._conn
        super().lost(why)
        if isinstance(conn, Connection) and conn.acks:  # their PubAcks can no longer arrive
            outcome = Retry(UNAVAILABLE, f"cannot reach {self.name}: {why}")
            self.done_many((report, outcome) for report, _ in conn.acks.values())
            conn.acks.clear()

    def dispatch(self, items: list[Item]) -> None:
        # One task per burst, not per event: each publish only writes to the connection's
        # buffer, and each PubAck settles its event from the reply subscription.
        self._loop.create_task(self._burst(items))

    async def _burst(self, items: list[Item]) -> None:
        try:
            conn = await self.client()
        except Exception as exc:
            outcome = self.failure(exc)
            self.done_many((report, outcome) for _, report in items)
            return
        # A JetStream publish is a core publish with a reply subject; the stream answers
        # on it. Done here rather than with nats-py's publish_async, which per message
        # draws random bytes from the OS (a system call that hands the GIL to the relay's
        # thread), waits on a semaphore and builds a future and a PubAck dataclass.
        publish, max_payload, acks, prefix = conn.nc.publish, conn.nc.max_payload, conn.acks, conn.prefix
        tokens = []
        for event, report in items:
            token = ""
            try:
                headers = text_headers(event)
                server_headers(headers)
                repair = headers.get(REPAIR_HEADER)  # sent again by verify --repair: not a duplicate
                headers["Nats-Msg-Id"] = event.event_id if repair is None else f"{event.event_id}.{repair}"
                if len(event.payload) > max_payload:
                    raise Refused(
                        "message_too_large",
                        f"{len(event.payload)} bytes is larger than the server's max_payload {max_payload}",
                    )
                conn.sent += 1
                token = str(conn.sent)
                acks[token] = (report, event.topic)
                await publish(event.topic, event.payload, reply=prefix + token, headers=headers)
            except Exception as exc:
                acks.pop(token, None)
                self.done(report, self._failed(exc, conn, event.topic))
                continue
            tokens.append(token)
        if tokens:
            self._loop.call_later(self.timeout, self._expire, conn, tokens)

    async def _replied(self, conn: Connection, msg: Any) -> None:
        """A PubAck (or an error) on a reply subject (loop thread)."""
        entry = conn.acks.pop(msg.subject[conn.cut :], None)
        if entry is None:
            return  # its publish already timed out
        report, topic = entry
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            outcome: Outcome = Retry(
                "no_stream", f"no JetStream stream of {self.name} takes subject {topic!r}"
            )
        else:
            try:
                reply = json.loads(msg.data)
                error = reply.get("error")
                if error is not None:
                    outcome = self._api_error(error)
                else:
                    self.confirmed()
                    outcome = Delivered(None, reply["seq"], reply["stream"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                outcome = Retry("bad_reply", f"{self.name}: unexpected reply to a publish: {exc}")
        self.done(report, outcome)

    def _expire(self, conn: Connection, tokens: list[str]) -> None:
        outcome = Retry(TIMEOUT, f"{self.name} did not acknowledge within {self.timeout:g} s")
        acks = conn.acks
        expired = [entry[0] for entry in map(acks.pop, tokens, repeat(None)) if entry is not None]
        if expired:
            self.done_many((report, outcome) for report in expired)
            self.timed_out()

    def _failed(self, exc: Exception, conn: Connection, topic: str) -> Outcome:
        """The outcome of a publish that raised ``exc``."""
        if isinstance(exc, nats.errors.BadSubjectError):
            return Dead("invalid_subject", f"{topic!r} is not a valid NATS subject")
        if isinstance(exc, nats.errors.BadHeaderError):  # a name the client cannot send
            return Dead("invalid_header", f"{self.name}: {self.clean(exc)}")
        if isinstance(exc, nats.errors.MaxPayloadError):
            return Dead("message_too_large", f"{self.name}: {self.clean(exc)}")
        if isinstance(exc, LOST):
            if conn is self._conn:
                self.lost(f"connection lost: {self.clean(exc)}")
            return Retry(UNAVAILABLE, f"cannot reach {self.name}: {self.clean(exc)}")
        return self.failure(exc)

    def _api_error(self, error: dict[str, Any]) -> Outcome:
        """The outcome of a JetStream error reply (``{"code", "err_code", "description"}``)."""
        code = error.get("err_code") or error.get("code") or 0
        text = f"{self.name}: JetStream error {code}: {error.get('description', '')}"
        # 10054: maximum message size exceeded; 10039/10041 (and 400 codes): malformed for the stream.
        if error.get("code") in (400, 413) or error.get("err_code") in (10054,):
            return Dead(f"jetstream_{code}", text)
        return Retry(f"jetstream_{code}", text)
