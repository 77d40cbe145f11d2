"""Amazon Kinesis: a stream's records, the event's key as the partition key (a JSON envelope of
the whole event with ``envelope=json``). The batching, the client and the answers are
:class:`~outbox.sinks.aws.AwsSink`'s."""

from __future__ import annotations

import base64
import json
from typing import Any

from outbox.errors import ConfigError
from outbox.events import EVENT_ID_HEADER, ClaimedEvent
from outbox.sinks.aio import as_bytes
from outbox.sinks.aws import AwsSink, Entry, loose
from outbox.sinks.base import Delivered, Outcome, Retry, key_digest
from outbox.sinks.routes import SinkURL


def partition_key(key: bytes | None, event_id: str) -> str:
    """A Kinesis record's partition key: the event's key as text (its id when null), or a digest
    of it when Kinesis would refuse its length (1-256)."""
    text = key.decode("utf-8", "replace") if key is not None else event_id
    return text if 1 <= len(text) <= 256 else key_digest(key or b"")


class KinesisSink(AwsSink):
    scheme = "kinesis"
    system = "aws_kinesis"
    service = "kinesis"
    operation = "PutRecords"
    batch = 500
    batch_bytes = 5 * 1024 * 1024
    entry_bytes = 1024 * 1024

    def __init__(self, url: SinkURL, *, timeout: float, source: str | None = None) -> None:
        self.envelope = url.options.get("envelope") == "json"
        super().__init__(url, timeout=timeout, source=source)

    @classmethod
    def check(cls, url: SinkURL, source: str | None) -> str:
        envelope = url.options.get("envelope", "")
        if envelope not in ("", "json"):
            raise ConfigError(f"route {url.display}: option envelope must be json, got {envelope!r}")
        return super().check(url, source)

    async def resolve(self, client: Any) -> None:
        await client.describe_stream_summary(StreamName=self.resource)

    def entry(self, event: ClaimedEvent) -> Entry:
        key = partition_key(event.key, event.event_id)
        data = self._envelope(event) if self.envelope else event.payload
        return Entry({"Data": data, "PartitionKey": key}, len(data) + len(key.encode()))

    @staticmethod
    def _envelope(event: ClaimedEvent) -> bytes:
        out: dict[str, Any] = {
            "id": event.event_id,
            "topic": event.topic,
            "key": None if event.key is None else loose(event.key),
            "headers": {n: loose(as_bytes(v)) for n, v in event.headers if n != EVENT_ID_HEADER},
        }
        try:
            out["payload"] = json.loads(event.payload)
        except ValueError:
            out["payload_base64"] = base64.b64encode(event.payload).decode("ascii")
        return json.dumps(out, separators=(",", ":"), ensure_ascii=False).encode()

    async def send(self, client: Any, bodies: list[dict[str, Any]]) -> Any:
        return await client.put_records(StreamName=self.resource, Records=bodies)

    def settle(self, answer: Any, n: int) -> list[Outcome]:
        records = answer.get("Records", [])
        outcomes: list[Outcome] = []
        for i in range(n):
            r = records[i] if i < len(records) else {}
            if r.get("SequenceNumber") and not r.get("ErrorCode"):
                shard = str(r.get("ShardId", "")).rsplit("-", 1)[-1]  # shardId-000000000001
                number = int(shard) if shard.isdigit() else None
                outcomes.append(Delivered(number, None, str(r["SequenceNumber"])))
            elif r.get("ErrorCode"):
                # Kinesis's per-record errors are throughput and its own faults: both retried.
                code = str(r["ErrorCode"])
                outcomes.append(self.entry_failure(code, str(r.get("ErrorMessage", "")), False))
            else:
                outcomes.append(Retry("no_answer", f"{self.name}: the answer left this record out"))
        return outcomes
