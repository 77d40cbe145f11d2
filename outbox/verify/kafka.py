"""Kafka read back: each event at its topic, partition and offset, fetched by ranges.

An offset below the partition's low watermark was removed by the topic's retention or
compaction (expired); one at or past its high watermark is past the log's end, so the log was
truncated or started again (missing), as is a topic or partition that no longer exists.
"""

from __future__ import annotations

import time
from collections import deque

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, TopicPartition

from outbox.events import EVENT_ID_HEADER
from outbox.verify.outcome import EXPIRED, MISSING, Archived, Held, Reader, Verdict, by_place, judge

# The producer's settings a consumer takes too (how to reach and log in to the brokers); the rest
# (acks, linger.ms) are the producer's alone.
SHARED = ("security.", "sasl.", "ssl.", "socket.", "client.", "broker.", "metadata.", "reconnect.")
Place = tuple[str, int]  # a topic and partition
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
        self._topics: dict[str, set[int] | None] = {}  # a topic's partitions (None: gone), asked once
        self._marks_at: dict[Place, tuple[int, int]] = {}
        self.consumer = Consumer(
            {
                **shared,
                "bootstrap.servers": bootstrap,
                "group.id": "outbox-verify",  # never committed: offsets are assigned
                "enable.auto.commit": False,
                "enable.partition.eof": True,
                "auto.offset.reset": "error",
                "fetch.wait.max.ms": 20,  # at the end of a log, told so at once
                "max.partition.fetch.bytes": 8 << 20,  # fewer round trips through a range
            }
        )

    def check(self, events: list[Archived]) -> list[Verdict]:
        verdicts, groups = by_place(events, _place, "partition and offset")
        wanted: dict[Place, list[int]] = {}
        for place, group in groups.items():
            gone = self._gone(*place)
            if gone is not None:
                verdicts.update({id(e): Verdict(MISSING, gone) for e in group})
                continue
            low, _ = self._marks(place)
            for event in group:
                assert event.offset is not None
                if event.offset < low:
                    verdicts[id(event)] = Verdict(EXPIRED, f"the partition's log now starts at {low}")
            offsets = sorted({e.offset for e in group if e.offset is not None and e.offset >= low})
            if offsets:
                wanted[place] = offsets
        held = self._read(wanted)
        for place, offsets in wanted.items():
            found = held.get(place, {})
            if len(found) < len(offsets):
                self._marks_at.pop(place, None)  # the log may have moved on meanwhile: ask again
            low, high = self._marks(place)
            for event in groups[place]:
                if id(event) in verdicts:
                    continue
                assert event.offset is not None
                if event.offset in found:
                    verdicts[id(event)] = judge(
                        event, found[event.offset], compare_bodies=self.compare_bodies
                    )
                elif event.offset < low:
                    verdicts[id(event)] = Verdict(EXPIRED, f"the partition's log now starts at {low}")
                elif event.offset >= high:
                    verdicts[id(event)] = Verdict(MISSING, f"the partition's log ends before it (at {high})")
                else:
                    verdicts[id(event)] = judge(event, None)
        return [verdicts[id(e)] for e in events]

    def _gone(self, topic: str, partition: int) -> str | None:
        """Why the partition no longer exists, from the brokers' metadata (asked first: the client
        knows no partition before it has it; once a topic a reader), or None."""
        if topic not in self._topics:
            meta = self.consumer.list_topics(topic, timeout=self.timeout).topics.get(topic)
            if meta is None or (
                meta.error is not None and meta.error.code() == KafkaError.UNKNOWN_TOPIC_OR_PART
            ):
                self._topics[topic] = None
            elif meta.error is not None:
                raise KafkaException(meta.error)
            else:
                self._topics[topic] = set(meta.partitions)
        partitions = self._topics[topic]
        if partitions is None:
            return "its topic no longer exists"
        if partition not in partitions:
            return f"its partition no longer exists (the topic has {len(partitions)})"
        return None

    def _marks(self, place: Place) -> tuple[int, int]:
        """The partition's low and high watermarks (once a reader, unless dropped)."""
        if place not in self._marks_at:
            low, high = self.consumer.get_watermark_offsets(
                TopicPartition(*place), timeout=self.timeout, cached=False
            )
            self._marks_at[place] = (int(low), int(high))
        return self._marks_at[place]

    def _read(self, wanted: dict[Place, list[int]]) -> dict[Place, dict[int, Held]]:
        """The records at each partition's ``wanted`` offsets (ascending): every partition read
        at once, through its range, seeking over gaps; past its high watermark too (a broker's
        may lag behind what it holds: Tansu's counts batches)."""
        held: dict[Place, dict[int, Held]] = {place: {} for place in wanted}
        if not wanted:
            return held
        left = {place: deque(offsets) for place, offsets in wanted.items()}
        sets = {place: set(offsets) for place, offsets in wanted.items()}
        position = {place: offsets[0] for place, offsets in wanted.items()}
        starts = [TopicPartition(*place, offsets[0]) for place, offsets in wanted.items()]
        self.consumer.assign(starts)
        self.consumer.resume(starts)  # paused when an earlier read was done with it
        quiet_since = time.monotonic()
        while left:
            # consume() waits its whole timeout unless the batch fills: short waits, and the
            # reader's timeout only for a broker that sends nothing at all.
            messages = self.consumer.consume(num_messages=5000, timeout=FETCH_WAIT)
            now = time.monotonic()
            if messages:
                quiet_since = now
            elif now - quiet_since > self.timeout:
                break  # nothing for that long: what is left is not there
            ended: set[Place] = set()
            for message in messages:
                place = (str(message.topic()), int(message.partition() or 0))
                if place not in left:
                    continue
                if message.error() is not None:  # the end, or an offset out of range: no more
                    ended.add(place)
                    continue
                offset = message.offset()
                if offset is None or offset == OFFSET_INVALID:
                    continue
                position[place] = offset + 1
                if offset in sets[place]:
                    held[place][offset] = _held(message)
            for place in list(left):
                queue = left[place]
                while queue and queue[0] < position[place]:
                    queue.popleft()
                if not queue or place in ended:
                    del left[place]
                    self.consumer.pause([TopicPartition(*place)])
                elif queue[0] - position[place] > SEEK_OVER:  # a seek is cheaper than reading through
                    position[place] = queue[0]
                    self.consumer.seek(TopicPartition(*place, queue[0]))
        return held

    def close(self) -> None:
        self.consumer.close()


def _place(event: Archived) -> Place | None:
    return None if event.partition is None or event.offset is None else (event.topic, event.partition)


def _held(message: object) -> Held:
    headers = dict(message.headers() or [])  # type: ignore[attr-defined]
    raw = headers.get(EVENT_ID_HEADER)
    event_id = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else None
    return Held(event_id, message.key(), message.value() or b"", key_returned=True)  # type: ignore[attr-defined]
