"""CloudEvents 1.0 in binary content mode: the event's attributes as each protocol's headers.

``outbox relay --cloudevents --cloudevents-source URI`` wraps every route's sink in
:class:`CloudEventsSink`, which adds the attributes to the event's headers before the sink
sends them as it sends any header. The payload stays the message body (binary mode), and the
event's ``content-type`` header is the ``datacontenttype`` attribute in every binding that
has one (Kafka, HTTP, NATS; AMQP takes it as the ``content-type`` property, which the
RabbitMQ sink sets from the same header).

======================  ================  =============================================
sink                    header names      binding
======================  ================  =============================================
Kafka                   ``ce_<attr>``     Kafka protocol binding 1.0
webhooks (HTTP)         ``ce-<attr>``     HTTP protocol binding 1.0
RabbitMQ (AMQP 0-9-1)   ``cloudEvents:``  AMQP protocol binding (application properties
                        ``<attr>``        = the message's headers table)
NATS                    ``ce-<attr>``     NATS protocol binding, binary mode (headers,
                                          NATS 2.2+), as the Go SDK implements it
Redis Streams           ``ce_<attr>``     no binding exists: in the entry's ``headers``
                                          field, named as in Kafka (the closest:
                                          a log with string headers)
======================  ================  =============================================

Over HTTP, every ``ce-`` header's value is percent-encoded as the binding says (section
3.1.3.2): space, ``"``, ``%`` and everything outside U+0021-U+007E, as UTF-8 bytes ``%XX``.

Attributes: ``id`` = the event id, ``source`` = ``--cloudevents-source``, ``specversion``
= ``1.0``, ``type`` = ``enqueue(type=...)`` (default: the topic), ``time`` = the event's
creation time (RFC 3339, UTC, microseconds), ``subject`` = ``enqueue(subject=...)`` when
given.
"""

from __future__ import annotations

import time
from urllib.parse import quote, urlsplit

from outbox.errors import ConfigError
from outbox.events import ClaimedEvent
from outbox.sinks.base import Outcome, Report, Sink, SinkWrapper

SPECVERSION = b"1.0"
PREFIXES = {
    "kafka": "ce_",
    "http": "ce-",
    "https": "ce-",
    "amqp": "cloudEvents:",
    "amqps": "cloudEvents:",
    "nats": "ce-",
    "tls": "ce-",
    "redis": "ce_",
    "rediss": "ce_",
}


# What the HTTP binding leaves as it is in a header value: printable ASCII but space, '"' and '%'.
_HTTP_SAFE = "".join(chr(c) for c in range(0x21, 0x7F) if chr(c) not in '"%')


def http_header_value(value: bytes) -> bytes:
    """A ``ce-`` header's value as the HTTP binding sends it: percent-encoded (UTF-8 bytes)."""
    return quote(value, safe=_HTTP_SAFE).encode("ascii")


def validate_source(source: object, field: str = "--cloudevents-source") -> str:
    """A non-empty URI-reference (CloudEvents ``source``), printable, without spaces."""
    if not isinstance(source, str) or not source:
        raise ConfigError(f"{field}: required with --cloudevents, a URI-reference such as /orders-service")
    if not source.isprintable() or " " in source:
        raise ConfigError(f"{field}: a URI-reference has no spaces or control characters")
    try:
        urlsplit(source)
    except ValueError as exc:
        raise ConfigError(f"{field}: not a URI-reference: {exc}") from None
    return source


def rfc3339(seconds: float) -> str:
    """``2026-11-23T06:56:43.123456Z`` for a time in seconds since the epoch."""
    whole = int(seconds)
    micros = round((seconds - whole) * 1_000_000)
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{micros:06d}Z"


class CloudEventsSink(SinkWrapper):
    """Adds the CloudEvents attributes of each event to its headers, named for ``scheme``."""

    def __init__(self, inner: Sink, scheme: str, source: str) -> None:
        super().__init__(inner)
        if scheme not in PREFIXES:
            raise ConfigError(f"--cloudevents: no CloudEvents mapping for {scheme}:// routes")
        prefix = PREFIXES[scheme]
        self._names = tuple(prefix + a for a in ("id", "source", "specversion", "type", "time", "subject"))
        self._lower = frozenset(n.lower() for n in self._names)
        self._source = validate_source(source).encode()
        self._http = scheme in ("http", "https")

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        id_, source, specversion, type_, time_, subject = self._names
        # The attributes are the relay's: a writer's header of the same name (ce_id, ce-type...)
        # would stand beside them, and a consumer might read the writer's. Its extensions stay.
        lower = self._lower
        headers = [
            *(h for h in event.headers if h[0].lower() not in lower),
            (id_, event.event_id.encode()),
            (source, self._source),
            (specversion, SPECVERSION),
            (type_, (event.type or event.topic).encode()),
            (time_, rfc3339(event.created_at).encode()),
        ]
        if event.subject is not None:
            headers.append((subject, event.subject.encode()))
        if self._http:  # the writer's ce- extensions too: the binding's rule is for every one
            headers = [
                (k, http_header_value(v.encode() if isinstance(v, str) else v))
                if k[:3].lower() == "ce-" and v is not None
                else (k, v)
                for k, v in headers
            ]
        return self.inner.produce(event._replace(headers=headers), report)
