"""Google Cloud Pub/Sub sink: ``pubsub://PROJECT/TOPIC[?endpoint=HOST:PORT]`` (``outbox-relay[gcp]``).

Client: Google's own publisher (``google-cloud-pubsub``), with message ordering on. It batches
and sends on threads of its own; this sink hands it each burst in order on the sink's loop, and
turns its futures into reports. ``PUBSUB_EMULATOR_HOST`` is honoured as Google's clients honour
it; credentials come from Application Default Credentials, never from the URL. ``?endpoint=``
names a regional endpoint (Google's advice for ordering keys: publish a key through one region).

- Data: the payload. Attributes: ``event-id``, then the event's headers in order. A header that
  Pub/Sub cannot take as an attribute (a name over 256 bytes or starting with ``goog``, a value
  that is not UTF-8 or is over 1,024 bytes), and any past the 100th attribute, go into one
  attribute ``outbox-headers`` (a JSON object, values as text or ``{"base64": …}``), as the SQS
  sink does; if that attribute itself would be over 1,024 bytes, the event is a dead letter
  (``invalid_attributes``): Pub/Sub would refuse it for good.
- Ordering key: the event's key, when it is UTF-8 text of at most 1,024 bytes that does not
  start with ``sha256-``; else ``sha256-<hex>`` of it (the same key, the same ordering key; no
  text key can name another key's digest) with the key itself in the ``event-key`` attribute
  when it fits there (else the digest alone stands for it). A keyless event has none.
- Delivered when the publish future resolves; the archive keeps the message id (``sink_ref``).
- One attempt a publish, within the delivery timeout: with message ordering on, Google's publisher
  would retry a failed batch for ever (it stretches any retry it is given), and a publisher
  dropped in an outage published its batch when the service came back, after the relay had sent
  the same events, and later ones of their keys, again. The relay retries instead.

Per-key order: Google's publisher sends an ordering key's messages in order, and after a
failed publish it pauses the key: every later publish of it fails until ``resume_publish``. The
sink does the same across publishers and for what it gave up waiting for: once an event of a
key is to be retried, the key's later events are refused (retried, kind ``ordering_key_paused``)
until that retry comes, and a publisher dropped in an outage fails everything it still holds
first. So a key's failures are a suffix of what is in flight, as with Kafka
(``keeps_key_order``). A retry (an event with failed attempts) resumes the key: the relay
retries a key's earliest event first, so nothing overtakes it.

Errors: a message too large for Pub/Sub (10 MB a request), an invalid argument, invalid
attributes -> dead. A missing topic, credentials that do not work (permission denied,
unauthenticated), an unreachable service or emulator (refused or unanswered attempts with
nothing confirmed for a second) -> the sink is down: retried, one line in the log, ``/readyz``
says why. An attempt refused while others get through -> that event is retried (kind
``unavailable``). A publish to a paused key -> retried (kind ``ordering_key_paused``).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from typing import Any

from google.api_core import exceptions as gexc
from google.cloud import pubsub_v1
from google.cloud.pubsub_v1.publisher import exceptions as pexc

from outbox.events import EVENT_ID_HEADER, KEY_HEADER, ClaimedEvent
from outbox.sinks.aio import UNAVAILABLE, AsyncSink, Item, Refused, Unavailable, as_bytes, cancel_unfinished
from outbox.sinks.base import DIGEST_PREFIX, Dead, Delivered, Outcome, Report, Retry, key_digest
from outbox.sinks.routes import SinkURL

MAX_ATTRIBUTES = 100
MAX_NAME_BYTES = 256
MAX_VALUE_BYTES = 1024
MAX_ORDERING_KEY_BYTES = 1024
OVERFLOW_ATTRIBUTE = "outbox-headers"
PAUSED = "ordering_key_paused"  # the retry kind of a publish to a key paused by a failure
# Failures that say the sink cannot publish at all now (not this event): it counts as down.
DOWN = (
    gexc.NotFound,  # the topic does not exist
    gexc.PermissionDenied,
    gexc.Unauthenticated,
)
# Failures of an attempt that say the service did not take it: the sink counts as down when
# nothing got through for QUIET s either (refused connections, an outage), else the event alone
# is retried (Pub/Sub's passing UNAVAILABLE, which Google's client would have retried at once).
UNREACHED = (gexc.ServiceUnavailable, gexc.DeadlineExceeded)
QUIET = 1.0
# What the publisher fails a batch with when it cancels it, a RuntimeError saying why (its
# BatchCancellationReason, in a private module): an earlier batch of the key failed (the key is
# paused), or the publisher was stopped. Any other RuntimeError is unexpected, and said.
PRIOR_FAILED = "prior ordered message for the same key has failed"
CLIENT_STOPPED = "publisher client has been stopped"


def ordering_key(key: bytes | None) -> tuple[str, bool]:
    """The ordering key for an event key, and whether it is the key itself (else its digest: a
    key that is no UTF-8 text, over 1,024 bytes, or that looks like a digest itself)."""
    if key is None:
        return "", True
    try:
        text = key.decode("utf-8")
    except UnicodeDecodeError:
        text = ""
    if text and len(key) <= MAX_ORDERING_KEY_BYTES and not text.startswith(DIGEST_PREFIX):
        return text, True
    return key_digest(key), False


def _attribute_value(raw: bytes) -> str | None:
    """``raw`` as an attribute value, or None when Pub/Sub cannot take it as one."""
    if len(raw) > MAX_VALUE_BYTES:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _name_ok(name: str) -> bool:
    return 0 < len(name.encode()) <= MAX_NAME_BYTES and not name.lower().startswith("goog")


def _loose(raw: bytes) -> Any:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode("ascii")}


def attributes(event: ClaimedEvent, key_is_ordering_key: bool) -> dict[str, str]:
    """The message's attributes (see the module's docstring); Refused when they cannot fit. A key
    sent as its digest goes in ``event-key`` when it fits there; when it does not, the ordering
    key (the digest) stands for it alone: a key too long for an attribute is no reason to refuse
    an event enqueue took."""
    if not key_is_ordering_key and event.key is not None:
        with contextlib.suppress(Refused):
            return _attributes(event, [(KEY_HEADER, event.key)])
    return _attributes(event, [])


def _attributes(event: ClaimedEvent, key: list[tuple[str, bytes]]) -> dict[str, str]:
    items: list[tuple[str, bytes]] = [(EVENT_ID_HEADER, event.event_id.encode()), *key]
    items += [(n, as_bytes(v)) for n, v in event.headers if n != EVENT_ID_HEADER]
    out: dict[str, str] = {}
    rest: dict[str, Any] = {}
    for name, raw in items:
        value = _attribute_value(raw)
        fits = _name_ok(name) and name not in out and name != OVERFLOW_ATTRIBUTE
        if value is not None and fits and len(out) < MAX_ATTRIBUTES - 1:  # one left for the overflow
            out[name] = value
        else:
            rest[name] = _loose(raw)
    if rest:
        overflow = json.dumps(rest, separators=(",", ":"), ensure_ascii=False)
        if len(overflow.encode()) > MAX_VALUE_BYTES:
            raise Refused(
                "invalid_attributes",
                f"headers Pub/Sub cannot take as attributes ({', '.join(map(repr, list(rest)[:5]))}) "
                f"need {len(overflow.encode())} bytes in {OVERFLOW_ATTRIBUTE}, at most {MAX_VALUE_BYTES}",
            )
        out[OVERFLOW_ATTRIBUTE] = overflow
    return out


class PubSubSink(AsyncSink):
    scheme = "pubsub"
    system = "gcp_pubsub"
    keeps_key_order = True  # the publisher keeps a key's order and pauses it on a failure

    def __init__(self, url: SinkURL, *, timeout: float) -> None:
        self.project, self.topic = url.parts.netloc, url.parts.path.strip("/")
        self.endpoint_option = url.options.get("endpoint")
        self.path = f"projects/{self.project}/topics/{self.topic}"
        # Ordering keys with an event to be retried (loop thread): the key's later events are
        # refused until that retry comes (Google's publisher pauses a key only for its own
        # failures, and not across publishers), and the publishes still waiting.
        self._held: set[str] = set()
        self._inflight: set[asyncio.Task[None]] = set()
        super().__init__(url, timeout=timeout)

    async def connect(self) -> Any:
        options = {"api_endpoint": self.endpoint_option} if self.endpoint_option else None
        return pubsub_v1.PublisherClient(
            publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True),
            client_options=options,
        )

    async def disconnect(self, conn: Any) -> None:
        await asyncio.get_running_loop().run_in_executor(None, conn.stop)

    def lost(self, why: str) -> None:
        """The publisher is dropped (a new one is made after the backoff): what it still holds is
        failed first, its keys held, so that nothing of a key goes through the new publisher
        ahead of an event the old one may never deliver."""
        for task in list(self._inflight):
            task.cancel()
        super().lost(why)

    async def reachable(self) -> None:
        """The topic answers (a probe while the sink is down): a missing topic is an outage too.
        A publisher allowed to publish and not to look the topic up counts as up."""
        client = await self.client()
        try:
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: client.get_topic(topic=self.path, timeout=self.timeout)
            )
        except gexc.PermissionDenied:
            return

    def dispatch(self, items: list[Item]) -> None:
        self._loop.create_task(self._publish(items))

    async def _publish(self, items: list[Item]) -> None:
        """Hand the burst to the publisher in order, then report each as its future resolves."""
        try:
            client = await self.client()
        except Exception as exc:
            for event, report in items:
                self._report(event, report, self.failure(exc))
            return
        waiting: list[asyncio.Task[None]] = []
        for event, report in items:
            try:
                future = self._publish_one(client, event)
            except Exception as exc:
                self._report(event, report, self.failure(exc))
                continue
            task = self._loop.create_task(self._settle(future, event, report))
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)
            waiting.append(task)
        if waiting:
            self._loop.call_later(self.timeout, cancel_unfinished, waiting)

    def _publish_one(self, client: Any, event: ClaimedEvent) -> Any:
        key, itself = ordering_key(event.key)
        attrs = attributes(event, itself)
        if key in self._held:
            if event.attempts == 0:  # a later event of a key whose earlier one is to be retried
                raise pexc.PublishToPausedOrderingKeyException(key)
            # A retry: the relay retries a key's earliest event first. The publisher paused the
            # key if its own publish failed (not if the relay gave up waiting, or it is a new one).
            self._held.discard(key)
            with contextlib.suppress(RuntimeError, ValueError):
                client.resume_publish(self.path, key)
        # One attempt, within the delivery timeout (retry=None: no retry is the one setting Google's
        # publisher leaves alone with message ordering on; it stretches any other to 2**32 s, the
        # attempt's timeout too). The relay retries, persisted and with backoff. A batch retried
        # for ever outlived the publisher the sink dropped in an outage, and published its events
        # when the service came back, after the relay had sent them and later ones again.
        return client.publish(
            self.path, event.payload, ordering_key=key, retry=None, timeout=self.timeout, **attrs
        )

    async def _settle(self, future: Any, event: ClaimedEvent, report: Report) -> None:
        try:
            message_id = await asyncio.wrap_future(future)
        except asyncio.CancelledError:  # not confirmed in time, or the publisher was dropped
            if self.condition.active:
                outcome: Outcome = Retry(UNAVAILABLE, f"{self.name} is down: {self.condition.last_error}")
            else:
                outcome = Retry("timeout", f"{self.name} did not confirm within {self.timeout:g} s")
            self._report(event, report, outcome)
            self.timed_out()
            raise
        except Exception as exc:
            self._report(event, report, self.failure(exc))
            return
        self.confirmed()
        self.done(report, Delivered(ref=str(message_id)))

    def _report(self, event: ClaimedEvent, report: Report, outcome: Outcome) -> None:
        """A failure's report; a retry holds the event's key: its later events wait for it."""
        if isinstance(outcome, Retry) and event.key is not None:
            self._held.add(ordering_key(event.key)[0])
        self.done(report, outcome)

    def failure(self, exc: Exception) -> Outcome:
        cancelled = str(exc) if isinstance(exc, RuntimeError) else ""  # a batch the publisher cancelled
        if isinstance(exc, pexc.PublishToPausedOrderingKeyException) or PRIOR_FAILED in cancelled:
            return Retry(PAUSED, "an earlier event of its key failed; it goes after that one's retry")
        if CLIENT_STOPPED in cancelled:  # a publisher dropped in an outage
            return Retry(UNAVAILABLE, f"{self.name}: the publisher was dropped before it sent this")
        if isinstance(exc, pexc.MessageTooLargeError):
            return Dead("message_too_large", f"Pub/Sub refused it: {self.clean(exc)}")
        if isinstance(exc, (gexc.InvalidArgument, gexc.FailedPrecondition)):
            return Dead("invalid_argument", f"Pub/Sub refused it: {self.clean(exc)}")
        if isinstance(exc, DOWN) or (isinstance(exc, UNREACHED) and self.quiet_for() >= QUIET):
            why = "the topic does not exist" if isinstance(exc, gexc.NotFound) else self.clean(exc)
            self.lost(f"{self.path}: {why}")
            return Retry(UNAVAILABLE, f"cannot publish to {self.name}: {why}")
        if isinstance(exc, UNREACHED):  # others got through just now: this event is retried
            return Retry(UNAVAILABLE, f"{self.name}: {self.clean(exc)}")
        if isinstance(exc, Refused | Unavailable):
            return super().failure(exc)
        if isinstance(exc, gexc.GoogleAPICallError):
            return Retry(type(exc).__name__, f"{self.name}: {self.clean(exc)}")
        return super().failure(exc)

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]:
        return f"send {self.topic}", {
            "messaging.system": self.system,
            "messaging.destination.name": self.topic,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "outbox.topic": topic,
        }
