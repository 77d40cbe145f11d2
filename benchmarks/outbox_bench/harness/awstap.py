"""What an AWS sink received, read back for the fault harness (``--sink sqs://…`` and the rest).

The harness needs an endpoint it can put a proxy in front of (``?endpoint=``: moto or
LocalStack; against AWS itself a TCP proxy would break TLS), and makes the run's own
destination, named after the URL's with a tag:

- ``sqs://NAME``: a queue ``NAME-<tag>`` (``.fifo`` kept), read and deleted as it fills;
- ``sns://NAME``: a topic, and a queue subscribed to it with raw message delivery;
- ``eventbridge://NAME``: a bus, and a queue that a rule on it targets;
- ``kinesis://NAME``: a stream of two shards (the route adds ``envelope=json``: the event id).

The position of a record is its arrival order at the queue (SQS: moto keeps it; on AWS a
standard queue does not, which is why the tally's order check runs on the load's own
sequence numbers) or its sequence in its shard.
"""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from typing import Any
from urllib.parse import urlencode, urlsplit

import aiobotocore.session
from outbox_bench.harness.sinktaps import SinkTap

from outbox.sinks.routes import parse_url

SOURCE = "outbox-faults"


class AwsTap(SinkTap):
    def __init__(self, url: str, topic: str) -> None:
        parsed = parse_url(url, "--sink")
        options = parsed.options
        tag = uuid.uuid4().hex[:8]
        base = parsed.resource.removesuffix(".fifo")
        self.dest = f"{base}-{tag}" + (".fifo" if parsed.resource.endswith(".fifo") else "")
        self.region = options.get("region") or "us-east-1"
        self.endpoint = options["endpoint"]
        self.options = {k: v for k, v in options.items() if k != "endpoint"}
        if self.scheme == "eventbridge":
            self.options["source"] = SOURCE
        if self.scheme == "kinesis":
            self.options["envelope"] = "json"
            self.may_skip = True  # see sweep()
        super().__init__(url, topic)
        ep = urlsplit(self.endpoint)
        self.server = (ep.hostname or "127.0.0.1", ep.port or (443 if ep.scheme == "https" else 80))
        self.queue_url = ""
        self.position = 0
        self._iterators: dict[str, str] = {}  # Kinesis: shard id -> where the live read is

    def route(self, host: str, port: int) -> str:
        scheme = urlsplit(self.endpoint).scheme
        query = urlencode({**self.options, "endpoint": f"{scheme}://{host}:{port}"})
        return f"{self.scheme}://{self.dest}?{query}"

    def _client(self, service: str) -> Any:
        return aiobotocore.session.get_session().create_client(
            service, region_name=self.region, endpoint_url=self.endpoint
        )

    # -- the run's own destination ---------------------------------------------------

    def setup(self) -> None:
        asyncio.run(self._setup())

    async def _queue(self, name: str) -> str:
        async with self._client("sqs") as sqs:
            fifo = {"FifoQueue": "true"} if name.endswith(".fifo") else {}
            self.queue_url = (await sqs.create_queue(QueueName=name, Attributes=fifo))["QueueUrl"]
            got = await sqs.get_queue_attributes(QueueUrl=self.queue_url, AttributeNames=["QueueArn"])
            return str(got["Attributes"]["QueueArn"])

    async def _setup(self) -> None:
        if self.scheme == "sqs":
            await self._queue(self.dest)
        elif self.scheme == "sns":
            fifo = ".fifo" if self.dest.endswith(".fifo") else ""
            arn = await self._queue(self.dest.removesuffix(".fifo") + "-sub" + fifo)
            async with self._client("sns") as sns:
                attributes = {"FifoTopic": "true"} if self.dest.endswith(".fifo") else {}
                topic = (await sns.create_topic(Name=self.dest, Attributes=attributes))["TopicArn"]
                await sns.subscribe(
                    TopicArn=topic, Protocol="sqs", Endpoint=arn, Attributes={"RawMessageDelivery": "true"}
                )
        elif self.scheme == "eventbridge":
            arn = await self._queue(self.dest + "-target")
            async with self._client("events") as events:
                await events.create_event_bus(Name=self.dest)
                await events.put_rule(
                    Name="all", EventBusName=self.dest, EventPattern=json.dumps({"source": [SOURCE]})
                )
                target = {"Id": "q", "Arn": arn}
                await events.put_targets(Rule="all", EventBusName=self.dest, Targets=[target])
        else:
            async with self._client("kinesis") as kinesis:
                await kinesis.create_stream(StreamName=self.dest, ShardCount=2)

    def teardown(self) -> None:
        try:
            asyncio.run(self._teardown())
        except Exception:  # the endpoint may be gone with the run (moto stopped): nothing to clean
            return

    async def _teardown(self) -> None:
        if self.queue_url:
            async with self._client("sqs") as sqs:
                await sqs.delete_queue(QueueUrl=self.queue_url)
        if self.scheme == "kinesis":
            async with self._client("kinesis") as kinesis:
                await kinesis.delete_stream(StreamName=self.dest)

    # -- reading ------------------------------------------------------------------------

    async def read(self) -> None:
        self.ready.set()
        while not self.stop_event.is_set():
            try:
                got = await (self._read_stream() if self.scheme == "kinesis" else self._read_queue())
            except Exception:  # the endpoint away during a fault: read again
                got = 0
            if not got:
                await asyncio.sleep(0.2)

    async def _read_queue(self, to_the_end: bool = False) -> int:
        """Read and delete until the queue is empty (or the tap stops, unless ``to_the_end``)."""
        n = 0
        async with self._client("sqs") as sqs:
            while to_the_end or not self.stop_event.is_set():
                page = await sqs.receive_message(
                    QueueUrl=self.queue_url, MaxNumberOfMessages=10, MessageAttributeNames=["All"]
                )
                messages = page.get("Messages", [])
                if not messages:
                    return n
                for m in messages:
                    self.position += 1
                    self.record(*self._decode(m), self.position)
                handles = [
                    {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)
                ]
                await sqs.delete_message_batch(QueueUrl=self.queue_url, Entries=handles)
                n += len(messages)
        return n

    def _decode(self, m: dict[str, Any]) -> tuple[str, bytes]:
        if self.scheme == "eventbridge":
            envelope = json.loads(m["Body"])
            return envelope["resources"][0].removeprefix("urn:uuid:"), json.dumps(envelope["detail"]).encode()
        attributes = {k: v.get("StringValue", "") for k, v in m.get("MessageAttributes", {}).items()}
        body = m["Body"]
        encoded = attributes.get("outbox-body-encoding") == "base64"
        value = base64.b64decode(body) if encoded else body.encode()
        return attributes.get("event-id", ""), value

    def sweep(self) -> int:
        """What the live read has not recorded yet. Kinesis: every shard read again from its
        start (moto's threaded server can hand out a sequence number below one a reader has
        passed already). Queues: the rest of the queue, read until it is empty (what was read
        before was deleted; what is still there arrived but was not read yet: moto's SQS
        answers more slowly the more a queue holds, and a live read can fall behind)."""
        try:
            reading = self._reread() if self.scheme == "kinesis" else self._read_queue(to_the_end=True)
            added = asyncio.run(reading)
        except Exception:  # the endpoint gone: nothing more to find
            return 0
        self.found_by_reread += added
        return added

    async def _reread(self) -> int:
        added = 0
        async with self._client("kinesis") as kinesis:
            for shard in (await kinesis.list_shards(StreamName=self.dest))["Shards"]:
                it = (
                    await kinesis.get_shard_iterator(
                        StreamName=self.dest, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
                    )
                )["ShardIterator"]
                while it:
                    page = await kinesis.get_records(ShardIterator=it, Limit=1000)
                    for r in page["Records"]:
                        event_id, value = self._unwrap(r["Data"])
                        with self.lock:
                            known = event_id in self.first_seen
                        if not known:
                            self.position += 1
                            self.record(event_id, value, self.position)
                            added += 1
                    if not page["Records"]:
                        break
                    it = page.get("NextShardIterator")
        return added

    @staticmethod
    def _unwrap(data: bytes) -> tuple[str, bytes]:
        body = json.loads(data)
        if "payload_base64" in body:
            return body["id"], base64.b64decode(body["payload_base64"])
        return body["id"], json.dumps(body["payload"]).encode()

    async def _read_stream(self) -> int:
        n = 0
        async with self._client("kinesis") as kinesis:
            if not self._iterators:
                for shard in (await kinesis.list_shards(StreamName=self.dest))["Shards"]:
                    it = await kinesis.get_shard_iterator(
                        StreamName=self.dest, ShardId=shard["ShardId"], ShardIteratorType="TRIM_HORIZON"
                    )
                    self._iterators[shard["ShardId"]] = it["ShardIterator"]
            for shard, it in list(self._iterators.items()):
                page = await kinesis.get_records(ShardIterator=it, Limit=1000)
                self._iterators[shard] = page.get("NextShardIterator") or it
                for r in page["Records"]:
                    self.position += 1
                    self.record(*self._unwrap(r["Data"]), self.position)
                    n += 1
        return n
