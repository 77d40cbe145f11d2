"""AWS sinks: SQS (standard and FIFO), SNS, EventBridge and Kinesis (``outbox-relay[aws]``); Kinesis's
own part is :mod:`outbox.sinks.kinesis`.

Routes: ``sqs://QUEUE``, ``sns://TOPIC``, ``eventbridge://BUS``, ``kinesis://STREAM``, each
with ``?region=…`` (else the standard chain: ``AWS_REGION``, the profile) and
``?endpoint=…`` (LocalStack, moto, a VPC endpoint). Credentials come from the standard AWS
chain only (environment, profile, container and instance roles, web identity for IRSA), never
from the URL, which refuses a user or password.

Client: aiobotocore, botocore on asyncio, on :class:`~outbox.sinks.aio.AsyncSink`'s loop:
many batch calls in flight from one thread, the same outage handling, probes and logs as
the other asyncio sinks. botocore's own retries are off (one attempt per call): this sink
retries with the relay's persisted backoff, and says so in one line per outage.

Every call is a batch: ``SendMessageBatch`` and ``PublishBatch`` (10 entries), ``PutEvents``
(10), ``PutRecords`` (500), each also cut at the service's request size. A batch is settled
per event from the service's per-entry answer. The mapping, per service:

- SQS: body = the payload as text (UTF-8 that SQS accepts) or, when it is not, its base64
  with the attribute ``outbox-body-encoding: base64``. A ``.fifo`` queue gets
  ``MessageGroupId`` = the key (the event id when null) and ``MessageDeduplicationId`` = the
  event id. Archived: the message id (``sink_ref``), and on FIFO the sequence number too.
- SNS: the same body and attributes (``PublishBatch``); ``.fifo`` topics the same two ids.
- EventBridge: ``Detail`` = the payload, which must be a JSON object (else a dead letter,
  ``not_a_json_object``: EventBridge takes nothing else, and wrapping it would change what
  rules match on). ``DetailType`` = the event's type (else its topic), ``Source`` from
  ``?source=`` or ``--cloudevents-source``, ``Time`` = when the event was written,
  ``Resources`` = ``["urn:uuid:<event id>"]`` (the only free field: consumers dedupe on it),
  ``TraceHeader`` = the ``traceparent`` in X-Ray's form. Archived: the EventBridge event id.
- Kinesis: ``Data`` = the payload bytes, ``PartitionKey`` = the key (the event id when null).
  Kinesis records carry nothing else: ``?envelope=json`` sends instead one JSON object with
  ``id``, ``topic``, ``key``, ``headers`` and the payload (``payload``, or ``payload_base64``
  when it is not JSON). Archived: the shard (``sink_partition``, its number) and the
  sequence number (``sink_ref``).

Attributes (SQS, SNS): at most 10 per message. ``event-id``, ``event-topic``, ``event-key``,
``traceparent`` and ``tracestate`` come first, then the event's headers in order; a header
whose name or value SQS cannot take as it is, and every header past the tenth attribute, go
into one attribute ``outbox-headers`` (a JSON object, values as text or ``{"base64": …}``),
so nothing is dropped.

Errors: a per-entry failure that is the sender's fault (``SenderFault``, a malformed detail,
an oversized entry, not authorised) is a dead letter with the service's code and message;
throttling (``ThrottlingException``, ``ProvisionedThroughputExceededException``,
``RequestThrottled``, …) and the service's own faults are retried. A missing queue, topic,
bus or stream, and credentials that do not work, count as the sink being down: retried, one
line in the log, ``/readyz`` says why. docs/sinks.md has the table per service.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, ClassVar

import aiobotocore.session
from aiobotocore.config import AioConfig
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
)

from outbox.errors import ConfigError
from outbox.events import EVENT_ID_HEADER, ClaimedEvent
from outbox.sinks.aio import AsyncSink, Item, Refused, Unavailable, as_bytes
from outbox.sinks.base import DIGEST_PREFIX, Dead, Delivered, Outcome, Retry, key_digest
from outbox.sinks.routes import SinkURL

MAX_ATTRIBUTES = 10  # SQS and SNS: message attributes per message
MAX_CALLS = 16  # batch calls in flight per sink; the rest wait their turn (their timeout not yet running)
OVERFLOW_ATTRIBUTE = "outbox-headers"
ENCODING_ATTRIBUTE = "outbox-body-encoding"
FIRST = ("traceparent", "tracestate")  # headers that get an attribute of their own first

# Throttling, under the names the services give it: retried with backoff.
THROTTLED = frozenset(
    {
        "ThrottlingException",
        "Throttling",
        "ThrottledException",
        "RequestThrottled",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "RequestLimitExceeded",
        "SlowDown",
        "KMSThrottlingException",
        "KMSThrottling",
    }
)
# The destination or the credentials do not work: the sink is down, not the event.
DOWN = frozenset(
    {
        "AWS.SimpleQueueService.NonExistentQueue",
        "QueueDoesNotExist",
        "NotFound",
        "NotFoundException",
        "ResourceNotFoundException",
        "ExpiredToken",
        "ExpiredTokenException",
        "RequestExpired",
        "InvalidClientTokenId",
        "UnrecognizedClientException",
        "SignatureDoesNotMatch",
        "InvalidAccessKeyId",
        "AuthFailure",
    }
)
# The service's own faults: retried.
SERVER_FAULTS = frozenset(
    {"InternalError", "InternalFailure", "InternalException", "ServiceUnavailable", "KMSInternal"}
)
LOST = (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError, OSError)

# What SQS and SNS take as text (XML 1.0's characters).
_NOT_SQS_TEXT = re.compile("[^\t\n\r\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")
_ATTRIBUTE_NAME = re.compile(r"^[A-Za-z0-9_\-]([A-Za-z0-9_\-.]{0,254}[A-Za-z0-9_\-])?$")
_FIFO_ID = re.compile(r"^[!-~]{1,128}$")  # alphanumerics and punctuation, at most 128


def sqs_text(raw: bytes) -> str | None:
    """``raw`` as text SQS/SNS accept, or None when it is not."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if _NOT_SQS_TEXT.search(text) else text


def attribute_name_ok(name: str) -> bool:
    low = name.lower()
    return bool(_ATTRIBUTE_NAME.match(name)) and ".." not in name and not low.startswith(("aws.", "amazon."))


def fifo_id(raw: bytes) -> str:
    """A FIFO group id for a key: the key itself when SQS takes it (and it does not look like a
    digest), else a digest of it (the same key always maps to the same group, so its order
    holds, and no other key's text names that group)."""
    text = raw.decode("utf-8", "replace")
    if _FIFO_ID.match(text) and text.encode("utf-8") == raw and not text.startswith(DIGEST_PREFIX):
        return text
    return key_digest(raw)


def loose(raw: bytes) -> Any:
    """``raw`` as text where it is UTF-8, else as ``{"base64": ...}`` (a JSON value either way)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode("ascii")}


def message_attributes(event: ClaimedEvent, body_base64: bool) -> dict[str, dict[str, str]]:
    """The event's SQS/SNS message attributes (see the module's docstring)."""
    items: list[tuple[str, bytes]] = [
        (EVENT_ID_HEADER, event.event_id.encode()),
        ("event-topic", event.topic.encode()),
    ]
    if event.key is not None:
        items.append(("event-key", event.key))
    headers = [(n, as_bytes(v)) for n, v in event.headers if n != EVENT_ID_HEADER]
    items += [h for h in headers if h[0] in FIRST] + [h for h in headers if h[0] not in FIRST]
    out: dict[str, dict[str, str]] = {}
    if body_base64:
        out[ENCODING_ATTRIBUTE] = {"DataType": "String", "StringValue": "base64"}
    rest: dict[str, Any] = {}
    for name, raw in items:
        text = sqs_text(raw)
        fits = (
            attribute_name_ok(name)
            and text
            and name not in out
            and name not in (OVERFLOW_ATTRIBUTE, ENCODING_ATTRIBUTE)
        )
        if fits and len(out) < MAX_ATTRIBUTES and not rest:
            out[name] = {"DataType": "String", "StringValue": text}  # type: ignore[dict-item]
        else:
            rest[name] = loose(raw)
    if rest:
        if len(out) == MAX_ATTRIBUTES:  # make room for the overflow: the last one joins it
            last = next(reversed(out))
            rest = {last: out.pop(last)["StringValue"], **rest}
        out[OVERFLOW_ATTRIBUTE] = {
            "DataType": "String",
            "StringValue": json.dumps(rest, separators=(",", ":"), ensure_ascii=False),
        }
    return out


def attributes_size(attributes: dict[str, dict[str, str]]) -> int:
    """Bytes the attributes count for in SQS's message size (name, type and value)."""
    return sum(
        len(n.encode()) + len(a["DataType"]) + len(a.get("StringValue", "").encode())
        for n, a in attributes.items()
    )


def xray_trace_header(traceparent: bytes | None) -> str | None:
    """A W3C ``traceparent`` in X-Ray's form (``Root=1-…;Parent=…;Sampled=…``), or None."""
    if not traceparent:
        return None
    parts = traceparent.decode("ascii", "replace").split("-")
    if len(parts) != 4 or len(parts[1]) != 32 or len(parts[2]) != 16:
        return None
    trace, span, flags = parts[1], parts[2], parts[3]
    sampled = "1" if int(flags or "0", 16) & 1 else "0"
    return f"Root=1-{trace[:8]}-{trace[8:]};Parent={span};Sampled={sampled}"


@dataclass
class Entry:
    """One event's request entry and the bytes it counts for in the request."""

    body: dict[str, Any]
    size: int


def _header(event: ClaimedEvent, name: str) -> bytes | None:
    for n, v in event.headers:
        if n == name:
            return as_bytes(v)
    return None


class AwsSink(AsyncSink):
    """The common part: the client, batches cut by count and size, the answer settled per entry."""

    service: ClassVar[str] = ""
    batch: ClassVar[int] = 10  # entries per call
    batch_bytes: ClassVar[int] = 256 * 1024  # bytes per call
    entry_bytes: ClassVar[int] = 256 * 1024  # bytes per entry

    def __init__(self, url: SinkURL, *, timeout: float, source: str | None = None) -> None:
        self.region = self.check(url, source)
        options = url.options
        self.resource = url.resource
        self.endpoint = options.get("endpoint") or None
        self.fifo = self.resource.endswith(".fifo")
        self.source = options.get("source") or source
        super().__init__(url, timeout=timeout)
        self._calls = asyncio.Semaphore(MAX_CALLS)
        # One botocore session for every connection: a new one per reconnect loads the service's
        # model again, inside the connect timeout (decision 0013).
        self._session = aiobotocore.session.get_session()
        # What the credential chain may hold, masked in every error this sink shows.
        self._secrets += [
            os.environ[k] for k in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN") if os.environ.get(k)
        ]

    @classmethod
    def check(cls, url: SinkURL, source: str | None) -> str:
        """The route's region; ConfigError (one line, naming the route) if it cannot be used.
        The relay calls it at start, before it connects to anything."""
        region = url.options.get("region") or aiobotocore.session.get_session().get_config_variable("region")
        if not region:
            raise ConfigError(
                f"route {url.display}: no AWS region; add ?region=… to the URL or set AWS_REGION"
            )
        return str(region)

    # -- the connection: a client and the destination resolved -----------------------

    async def connect(self) -> Any:
        config = AioConfig(
            connect_timeout=self.timeout,
            read_timeout=self.timeout,
            retries={"total_max_attempts": 1, "mode": "standard"},
            max_pool_connections=64,
        )
        context = self._session.create_client(
            self.service, region_name=self.region, endpoint_url=self.endpoint, config=config
        )
        client = await context.__aenter__()
        try:
            await self.resolve(client)
        except BaseException:
            await context.__aexit__(None, None, None)
            raise
        return (context, client)

    async def disconnect(self, conn: Any) -> None:
        await conn[0].__aexit__(None, None, None)

    async def resolve(self, client: Any) -> None:
        """Check the destination exists (and learn its address); raise if not."""

    # -- sending --------------------------------------------------------------------

    def dispatch(self, items: list[Item]) -> None:
        chunk: list[tuple[Item, Entry]] = []
        size = 0
        for item in items:
            try:
                entry = self.entry(item[0])
            except Refused as exc:
                self.done(item[1], Dead(exc.kind, f"{self.name}: {exc}"))
                continue
            if entry.size > self.entry_bytes:
                self.done(
                    item[1],
                    Dead(
                        "too_large",
                        f"{self.name}: the message is {entry.size:,} bytes, {self.service} takes at most "
                        f"{self.entry_bytes:,}",
                    ),
                )
                continue
            if chunk and (len(chunk) == self.batch or size + entry.size > self.batch_bytes):
                self._loop.create_task(self._send_batch(chunk))
                chunk, size = [], 0
            chunk.append((item, entry))
            size += entry.size
        if chunk:
            self._loop.create_task(self._send_batch(chunk))

    async def _send_batch(self, chunk: list[tuple[Item, Entry]]) -> None:
        # A bounded number of calls at once: a backlog of thousands of events is not hundreds of
        # requests racing their own timeouts through one connection pool.
        async with self._calls:
            outcomes = await self.attempt(self._call([entry.body for _, entry in chunk]))
        if not isinstance(outcomes, list):  # the whole call failed
            outcomes = [outcomes] * len(chunk)
        self.done_many(zip([item[1] for item, _ in chunk], outcomes, strict=True))

    async def _call(self, bodies: list[dict[str, Any]]) -> list[Outcome]:
        conn = await self.client()
        try:
            answer = await self.send(conn[1], bodies)
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", "ClientError"))
            status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
            message = self.clean(exc.response.get("Error", {}).get("Message", ""))
            reason = f"{self.name}: {code}: {message}"
            if code in DOWN:
                if conn is self._conn:
                    self.lost(f"{code}: {message}")
                raise Unavailable(reason) from None
            self.confirmed()  # it answered
            if code in THROTTLED or code in SERVER_FAULTS or status >= 500:
                kind = "throttled" if code in THROTTLED else code
                return [Retry(kind, reason)] * len(bodies)
            if len(bodies) > 1:  # refused as a whole: find the entry it was about, one by one
                return [outcome for body in bodies for outcome in await self._call([body])]
            return [Dead(code, reason)]
        except NoCredentialsError as exc:
            if conn is self._conn:
                self.lost(self.clean(exc))
            raise Unavailable(f"{self.name}: {self.clean(exc)}") from None
        except LOST as exc:
            if conn is self._conn:
                self.lost(f"connection lost: {self.clean(exc)}")
            raise Unavailable(f"{self.name}: {self.clean(exc)}") from None
        except BotoCoreError as exc:
            raise Unavailable(f"{self.name}: {self.clean(exc)}") from None
        self.confirmed()
        return self.settle(answer, len(bodies))

    def entry_failure(self, code: str, message: str, sender_fault: bool) -> Outcome:
        reason = f"{self.name}: {code}: {self.clean(message)}"
        if code in THROTTLED:
            return Retry("throttled", reason)
        if sender_fault and code not in SERVER_FAULTS:
            return Dead(code, reason)
        return Retry(code, reason)

    # -- what a service implements --------------------------------------------------

    def entry(self, event: ClaimedEvent) -> Entry:
        raise NotImplementedError

    async def send(self, client: Any, bodies: list[dict[str, Any]]) -> Any:
        raise NotImplementedError

    def settle(self, answer: Any, n: int) -> list[Outcome]:
        raise NotImplementedError

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]:
        return f"send {self.resource}", {
            "messaging.system": self.system,
            "messaging.destination.name": self.resource,
            "messaging.operation.type": "send",
            "messaging.operation.name": self.operation,
            "cloud.region": self.region,
            "rpc.system": "aws-api",
            "rpc.service": self.service,
            "server.address": self.endpoint or f"{self.service}.{self.region}.amazonaws.com",
        }

    operation: ClassVar[str] = ""


def _ids(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The entries with their batch ids (their index)."""
    return [{"Id": str(i), **b} for i, b in enumerate(bodies)]


class _QueueLike(AwsSink):
    """SQS and SNS: a text body, message attributes, FIFO's group and deduplication ids, and an
    answer in two lists (``Successful``, ``Failed``) keyed by the entry's id."""

    body_field: ClassVar[str] = ""

    def entry(self, event: ClaimedEvent) -> Entry:
        text = sqs_text(event.payload)
        body = text if text is not None else base64.b64encode(event.payload).decode("ascii")
        attributes = message_attributes(event, body_base64=text is None)
        out: dict[str, Any] = {self.body_field: body, "MessageAttributes": attributes}
        if self.fifo:
            out["MessageGroupId"] = fifo_id(event.key) if event.key is not None else event.event_id
            out["MessageDeduplicationId"] = event.event_id
        return Entry(out, len(body.encode()) + attributes_size(attributes))

    def settle(self, answer: Any, n: int) -> list[Outcome]:
        outcomes: list[Outcome] = [Retry("no_answer", f"{self.name}: the answer left this entry out")] * n
        for ok in answer.get("Successful", []):
            seq = ok.get("SequenceNumber")
            ref = f"{ok['MessageId']}/{seq}" if seq else str(ok["MessageId"])
            outcomes[int(ok["Id"])] = Delivered(None, None, ref)
        for failed in answer.get("Failed", []):
            outcomes[int(failed["Id"])] = self.entry_failure(
                str(failed.get("Code", "Failed")),
                str(failed.get("Message", "")),
                bool(failed.get("SenderFault")),
            )
        return outcomes


class SqsSink(_QueueLike):
    scheme = "sqs"
    system = "aws_sqs"
    service = "sqs"
    operation = "SendMessageBatch"
    body_field = "MessageBody"
    entry_bytes = batch_bytes = 1024 * 1024  # SQS's limit since 2025 (was 256 KiB)

    async def resolve(self, client: Any) -> None:
        self.queue_url = (await client.get_queue_url(QueueName=self.resource))["QueueUrl"]

    async def send(self, client: Any, bodies: list[dict[str, Any]]) -> Any:
        return await client.send_message_batch(QueueUrl=self.queue_url, Entries=_ids(bodies))


class SnsSink(_QueueLike):
    scheme = "sns"
    system = "aws_sns"
    service = "sns"
    operation = "PublishBatch"
    body_field = "Message"

    async def resolve(self, client: Any) -> None:
        # The topic's ARN from the account the credentials are of: no permission is needed to
        # ask (sts:GetCallerIdentity), and the topic is checked by reading its attributes.
        async with self._session.create_client(
            "sts", region_name=self.region, endpoint_url=self.endpoint
        ) as sts:
            account = (await sts.get_caller_identity())["Account"]
        partition = "aws-cn" if self.region.startswith("cn-") else "aws"
        self.topic_arn = f"arn:{partition}:sns:{self.region}:{account}:{self.resource}"
        await client.get_topic_attributes(TopicArn=self.topic_arn)

    async def send(self, client: Any, bodies: list[dict[str, Any]]) -> Any:
        return await client.publish_batch(TopicArn=self.topic_arn, PublishBatchRequestEntries=_ids(bodies))


class EventBridgeSink(AwsSink):
    scheme = "eventbridge"
    system = "aws_eventbridge"
    service = "events"
    operation = "PutEvents"

    @classmethod
    def check(cls, url: SinkURL, source: str | None) -> str:
        if not (url.options.get("source") or source):
            raise ConfigError(
                f"route {url.display}: EventBridge needs a Source; add ?source=… to the URL "
                "or give --cloudevents-source"
            )
        return super().check(url, source)

    async def resolve(self, client: Any) -> None:
        await client.describe_event_bus(Name=self.resource)

    def entry(self, event: ClaimedEvent) -> Entry:
        try:
            detail = json.loads(event.payload)
        except ValueError:
            detail = None
        if not isinstance(detail, dict):
            raise Refused(
                "not_a_json_object",
                "EventBridge takes a JSON object as the event's Detail; this payload is not one",
            )
        text = event.payload.decode("utf-8")
        detail_type = event.type or event.topic
        out: dict[str, Any] = {
            "Source": self.source,
            "DetailType": detail_type,
            "Detail": text,
            "EventBusName": self.resource,
            "Time": datetime.fromtimestamp(event.created_at, timezone.utc),
            "Resources": [f"urn:uuid:{event.event_id}"],
        }
        trace = xray_trace_header(_header(event, "traceparent"))
        if trace:
            out["TraceHeader"] = trace
        size = 14 + len(str(self.source).encode()) + len(detail_type.encode()) + len(event.payload)
        size += len(out["Resources"][0])
        return Entry(out, size)

    async def send(self, client: Any, bodies: list[dict[str, Any]]) -> Any:
        return await client.put_events(Entries=bodies)

    def settle(self, answer: Any, n: int) -> list[Outcome]:
        entries = answer.get("Entries", [])
        outcomes: list[Outcome] = []
        for i in range(n):
            e = entries[i] if i < len(entries) else {}
            if e.get("EventId") and not e.get("ErrorCode"):
                outcomes.append(Delivered(None, None, str(e["EventId"])))
            elif e.get("ErrorCode"):
                code = str(e["ErrorCode"])
                retry = code in THROTTLED or code in SERVER_FAULTS
                outcomes.append(self.entry_failure(code, str(e.get("ErrorMessage", "")), not retry))
            else:
                outcomes.append(Retry("no_answer", f"{self.name}: the answer left this entry out"))
        return outcomes
