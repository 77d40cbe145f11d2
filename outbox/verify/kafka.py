"""Kafka read back: each event at its topic, partition and offset, fetched by ranges.

An offset below the partition's low watermark was removed by the topic's retention or
compaction (expired); one at or past its high watermark is past the log's end, so the log was
truncated or started again (missing), as is a topic or partition that no longer exists.
"""

from __future__ import annotations

import time
from collections import defaultdict

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition

from outbox.events import EVENT_ID_HEADER
from outbox.verify.outcome import EXPIRED, MISSING, Archived, Held, Reader, Verdict, judge

# The producer's settings a consumer takes too (how to reach and log in to the brokers); the rest
# (acks, linger.ms) are the producer's alone.
SHARED = ("security.", "sasl.", "ssl.", "socket.", "client.", "broker.", "metadata.", "reconnect.")
SEEK_OVER = 500  # offsets apart beyond which a seek is cheaper than reading through
FETCH_WAIT = 0.05  # seconds one consume() waits for a batch to fill


class KafkaReader(Reader):
    def __init__(
        self, bootstrap: str, config: dict[str, str] | None = None, *, timeout: float = 10.0,
        compare_bodies: bool = True,
    ) -> None:  # fmt: skip
        shared = {k: v for k, v in (config or {}).items() if k.startswith(SHARED)}
        self.timeout = timeout
        self.compare_bodies = compare_bodies
        self.consumer = Consumer(
            {
                **shared,
                "bootstrap.servers": bootstrap,
                "group.id": "outbox-verify",  # never committed: offsets are assigned
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "error",
                "fetch.wait.max.ms": 20,  # at the end of a log, told so at once
            }
        )

    def check(self, events: list[Archived]) -> list[Verdict]:
        verdicts: dict[int, Verdict] = {}
        groups: dict[tuple[str, int], list[Archived]] = defaultdict(list)
        for event in events:
            if event.partition is None or event.offset is None:
                verdicts[id(event)] = Verdict(MISSING, "the archive holds no partition and offset")
            else:
                groups[(event.topic, event.partition)].append(event)
        for (topic, partition), group in groups.items():
            verdicts.update(self._partition(topic, partition, group))
        return [verdicts[id(e)] for e in events]

    def _partition(self, topic: str, partition: int, group: list[Archived]) -> dict[int, Verdict]:
        gone = self._gone(topic, partition)
        if gone is not None:
            return {id(e): Verdict(MISSING, gone) for e in group}
        try:
            low, high = self.consumer.get_watermark_offsets(
                TopicPartition(topic, partition), timeout=self.timeout, cached=False
            )
        except KafkaException as exc:
            why = exc.args[0].str() if exc.args and isinstance(exc.args[0], KafkaError) else str(exc)
            return {id(e): Verdict(MISSING, f"its partition cannot be read: {why}") for e in group}
        out: dict[int, Verdict] = {}
        wanted: dict[int, list[Archived]] = defaultdict(list)
        for event in group:
            assert event.offset is not None
            if event.offset < low:
                out[id(event)] = Verdict(EXPIRED, f"the partition's log now starts at {low}")
            else:
                wanted[event.offset].append(event)
        # Read even past the high watermark: a broker's may lag behind what it holds (Tansu's
        # counts batches); what is not there once read is missing.
        held = self._read(topic, partition, sorted(wanted))
        for offset, events in wanted.items():
            for event in events:
                if offset not in held and offset >= high:
                    out[id(event)] = Verdict(MISSING, f"the partition's log ends before it (at {high})")
                else:
                    out[id(event)] = judge(event, held.get(offset), compare_bodies=self.compare_bodies)
        return out

    def _gone(self, topic: str, partition: int) -> str | None:
        """Why the partition no longer exists, from the brokers' metadata (asked first: the client
        knows no partition before it has it), or None."""
        meta = self.consumer.list_topics(topic, timeout=self.timeout).topics.get(topic)
        if meta is None or (meta.error is not None and meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART):
            return "its topic no longer exists"
        if meta.error is not None:
            raise KafkaException(meta.error)
        if partition not in meta.partitions:
            return f"its partition no longer exists (the topic has {len(meta.partitions)})"
        return None

    def _read(self, topic: str, partition: int, offsets: list[int]) -> dict[int, Held]:
        """The records at ``offsets`` (ascending): read through, seeking over gaps."""
        wanted, held = set(offsets), {}
        i = 0
        while i < len(offsets):
            start = position = offsets[i]
            self.consumer.assign([TopicPartition(topic, partition, start)])
            quiet_since = time.monotonic()
            while True:
                # consume() waits its whole timeout unless the batch fills: short waits, and the
                # reader's timeout only for a broker that sends nothing at all.
                messages = self.consumer.consume(num_messages=500, timeout=FETCH_WAIT)
                now = time.monotonic()
                if messages:
                    quiet_since = now
                ended = now - quiet_since > self.timeout  # nothing for that long: not there
                for message in messages:
                    if message.error() is not None:  # the end, or an offset out of range: no more
                        ended = True
                        break
                    offset = message.offset()
                    if offset is None or offset == OFFSET_INVALID:
                        continue
                    position = offset + 1
                    if offset in wanted:
                        held[offset] = _held(message)
                while i < len(offsets) and offsets[i] < position:
                    i += 1
                if ended or i == len(offsets) or offsets[i] - position > SEEK_OVER:
                    break  # at the end, done, or a seek is cheaper than reading through
            if position == start:
                i += 1  # nothing came back from where it began: that offset is not there
        return held

    def close(self) -> None:
        self.consumer.close()


def _held(message: object) -> Held:
    headers = dict(message.headers() or [])  # type: ignore[attr-defined]
    raw = headers.get(EVENT_ID_HEADER)
    event_id = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else None
    return Held(event_id, message.key(), message.value() or b"", key_returned=True)  # type: ignore[attr-defined]
