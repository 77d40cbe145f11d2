"""Amazon Kinesis read back: each event at its shard and sequence number (``GetShardIterator``
``AT_SEQUENCE_NUMBER``, then ``GetRecords``).

A sequence number identifies one record of a shard for good: the record found there is the
event's when its data (the payload, or the JSON envelope's ``id`` with ``?envelope=json``) and
partition key match. A sequence number before the shard's oldest record is past the stream's
retention: expired. A stream or shard that no longer exists, or a record that is not there
within the retention: missing.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiobotocore.session
from aiobotocore.config import AioConfig

from outbox.sinks.kinesis import KinesisSink, partition_key
from outbox.sinks.routes import SinkURL
from outbox.verify.outcome import EXPIRED, MISSING, Archived, Held, Reader, Verdict, by_place, judge


class KinesisReader(Reader):
    def __init__(self, url: SinkURL, *, timeout: float = 10.0, compare_bodies: bool = True) -> None:
        self.region = KinesisSink.check(url, None)
        self.stream = url.resource
        self.endpoint = url.options.get("endpoint") or None
        self.envelope = url.options.get("envelope") == "json"
        self.timeout = timeout
        self.compare_bodies = compare_bodies

    def check(self, events: list[Archived]) -> list[Verdict]:
        verdicts = asyncio.run(self._check(events))
        return [verdicts[id(e)] for e in events]

    async def _check(self, events: list[Archived]) -> dict[int, Verdict]:
        verdicts, shards = by_place(
            events, lambda e: e.partition if e.ref else None, "shard and sequence number"
        )
        if not shards:
            return verdicts
        config = AioConfig(connect_timeout=self.timeout, read_timeout=self.timeout,
                           retries={"total_max_attempts": 2, "mode": "standard"})  # fmt: skip
        session = aiobotocore.session.get_session()
        async with session.create_client(
            "kinesis", region_name=self.region, endpoint_url=self.endpoint, config=config
        ) as client:
            try:
                listed = (await client.list_shards(StreamName=self.stream))["Shards"]
            except client.exceptions.ResourceNotFoundException:
                return verdicts | {id(e): Verdict(MISSING, "its stream no longer exists") for g in
                                   shards.values() for e in g}  # fmt: skip
            starts = {s["ShardId"]: int(s["SequenceNumberRange"]["StartingSequenceNumber"]) for s in listed}
            for number, group in shards.items():
                shard = f"shardId-{number:012d}"
                if shard not in starts:
                    verdicts.update({id(e): Verdict(MISSING, "its shard no longer exists") for e in group})
                else:
                    verdicts.update(await self._shard(client, shard, starts[shard], group))
        return verdicts

    async def _shard(self, client: Any, shard: str, start: int, group: list[Archived]) -> dict[int, Verdict]:
        out: dict[int, Verdict] = {}
        oldest = await self._first(client, shard, {"ShardIteratorType": "TRIM_HORIZON"})
        for event in group:
            assert event.ref is not None
            record = await self._first(
                client,
                shard,
                {"ShardIteratorType": "AT_SEQUENCE_NUMBER", "StartingSequenceNumber": event.ref},
            )
            if record is not None and record["SequenceNumber"] == event.ref:
                out[id(event)] = judge(event, self._held(event, record), compare_bodies=self.compare_bodies)
            elif int(event.ref) < start:
                out[id(event)] = Verdict(MISSING, "before its shard began: the stream was made again")
            elif oldest is None or int(event.ref) < int(oldest["SequenceNumber"]):
                out[id(event)] = Verdict(EXPIRED, "before the shard's oldest record (the stream's retention)")
            else:
                out[id(event)] = Verdict(MISSING, "nothing at its sequence number")
        return out

    async def _first(self, client: Any, shard: str, where: dict[str, str]) -> dict[str, Any] | None:
        """The first record from ``where`` in ``shard``, or None."""
        answer = await client.get_shard_iterator(StreamName=self.stream, ShardId=shard, **where)
        records = (await client.get_records(ShardIterator=answer["ShardIterator"], Limit=1))["Records"]
        return records[0] if records else None

    def _held(self, event: Archived, record: dict[str, Any]) -> Held:
        data = bytes(record["Data"])
        if self.envelope:  # the envelope names the event; its payload is re-encoded JSON: ids only
            try:
                found = json.loads(data).get("id")
            except (ValueError, AttributeError):
                found = None
            return Held(found if isinstance(found, str) else None)
        # Plain records carry no event id: the sequence number is the event's, and what is there
        # must be its payload under the partition key the sink gave it.
        if record.get("PartitionKey") != partition_key(event.key, event.event_id):
            return Held(event.event_id, b"(another partition key)", data, key_returned=True)
        return Held(event.event_id, None, data)
