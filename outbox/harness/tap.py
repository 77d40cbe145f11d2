"""A consumer that reads a topic from the start and remembers what arrived.

For each message: its ``event-id`` header, the key and sequence number the
load wrote into its payload, when it arrived, and where it sits in the
broker's log (broker life, partition, offset) — per-key order is judged in
log order, which is what any consumer reading the topic sees.

``reset()`` after the broker came back empty (a new broker life); ``sweep()``
reads the whole topic once more and adds what the live read missed (Tansu's
memory engine has shown a rare fetch gap); ``caught_up()`` waits until the
live read reached every partition's end.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition

from outbox.harness.load import decode

SWEEP_TIMEOUT = 60.0  # seconds a full re-read may take


@dataclass
class Seen:
    event_id: str
    key: str
    seq: int
    at: float  # wall-clock arrival
    log: tuple[int, int, int] = (0, 0, 0)  # (broker life, partition, offset)


def event_id_of(msg: Any) -> str | None:
    raw = dict(msg.headers() or []).get("event-id")
    return raw.decode() if isinstance(raw, bytes) else None


class Tap(threading.Thread):
    """Reads ``topic`` from the beginning until ``stop_event`` is set."""

    scheme = "kafka"

    def __init__(self, bootstrap: str, topic: str, *, fetch_wait_ms: int = 50) -> None:
        super().__init__(name="harness-tap", daemon=True)
        self.bootstrap, self.topic = bootstrap, topic
        self.fetch_wait_ms = fetch_wait_ms
        self.seen: list[Seen] = []
        self.first_seen: dict[str, float] = {}
        self.stop_event = threading.Event()
        self.ready = threading.Event()  # assigned to the topic's partitions
        self._reset = threading.Event()
        self.positions: dict[int, int] = {}
        self.gaps = 0  # offsets the live consumer never received (a broker/fetch fault, not the relay's)
        self.generation = 0  # broker lives: bumped when the broker came back empty
        self.found_by_reread = 0  # records only a re-read of the topic delivered to us
        self.lock = threading.Lock()

    def reset(self) -> None:
        self._reset.set()

    def _config(self, group: str) -> dict[str, Any]:
        return {
            "bootstrap.servers": self.bootstrap,
            "group.id": group,
            "enable.auto.commit": False,
            "auto.offset.reset": "earliest",
            "fetch.wait.max.ms": self.fetch_wait_ms,
            "topic.metadata.refresh.interval.ms": 1000,
            "log_level": 0,
        }

    def _consumer(self) -> Consumer | None:
        while not self.stop_event.is_set():
            c = Consumer(self._config(f"harness-{uuid.uuid4().hex}"))
            try:
                meta = c.list_topics(self.topic, timeout=2).topics.get(self.topic)
                if meta is not None and meta.error is None and meta.partitions:
                    c.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in meta.partitions])
                    with self.lock:
                        self.positions = dict.fromkeys(meta.partitions, 0)
                    self.ready.set()
                    return c
            except KafkaException:
                pass
            c.close()
            self.stop_event.wait(0.2)
        return None

    def run(self) -> None:
        consumer = self._consumer()
        while consumer is not None and not self.stop_event.is_set():
            if self._reset.is_set():
                self._reset.clear()
                self.generation += 1
                consumer.close()
                consumer = self._consumer()
                continue
            for msg in consumer.consume(500, 0.05):
                if msg.error() is not None:
                    continue
                event_id = event_id_of(msg)
                if event_id is None:
                    continue
                key, seq = decode(msg.value())
                now = time.time()
                partition, offset = msg.partition() or 0, msg.offset() or 0
                with self.lock:
                    self.seen.append(Seen(event_id, key, seq, now, (self.generation, partition, offset)))
                    self.first_seen.setdefault(event_id, now)
                    if offset > self.positions.get(partition, 0):  # the fetch skipped offsets
                        self.gaps += offset - self.positions.get(partition, 0)
                    self.positions[partition] = offset + 1
        if consumer is not None:
            consumer.close()

    def count(self) -> int:
        with self.lock:
            return len(self.first_seen)

    def sweep(self) -> int:
        """Read the whole topic again from the start; add what the live read missed. Returns how many."""
        c = Consumer(self._config(f"harness-sweep-{uuid.uuid4().hex}"))
        added = 0
        try:
            meta = c.list_topics(self.topic, timeout=10).topics.get(self.topic)
            if meta is None or meta.error is not None:
                return 0
            ends = {
                p: c.get_watermark_offsets(TopicPartition(self.topic, p), timeout=10)[1]
                for p in meta.partitions
            }
            c.assign([TopicPartition(self.topic, p, OFFSET_BEGINNING) for p in meta.partitions])
            done: dict[int, int] = dict.fromkeys(meta.partitions, 0)
            deadline = time.monotonic() + SWEEP_TIMEOUT
            while any(done[p] < ends[p] for p in ends) and time.monotonic() < deadline:
                for msg in c.consume(1000, 0.5):
                    if msg.error() is not None:
                        continue
                    done[msg.partition() or 0] = (msg.offset() or 0) + 1
                    event_id = event_id_of(msg)
                    if event_id is None:
                        continue
                    key, seq = decode(msg.value())
                    with self.lock:
                        if event_id not in self.first_seen:
                            now = time.time()
                            log = (self.generation, msg.partition() or 0, msg.offset() or 0)
                            self.seen.append(Seen(event_id, key, seq, now, log))
                            self.first_seen[event_id] = now
                            added += 1
        except KafkaException:
            pass
        finally:
            c.close()
        self.found_by_reread += added
        return added

    def caught_up(self, timeout: float) -> bool:
        """Wait until the live read has reached every partition's high watermark."""
        probe = Consumer(
            {"bootstrap.servers": self.bootstrap, "group.id": "harness-watermarks", "log_level": 0}
        )
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                with self.lock:
                    positions = dict(self.positions)
                if positions and all(
                    probe.get_watermark_offsets(TopicPartition(self.topic, p), timeout=2)[1] <= pos
                    for p, pos in positions.items()
                ):
                    return True
                time.sleep(0.1)
            return False
        finally:
            probe.close()
