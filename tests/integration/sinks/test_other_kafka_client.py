"""A consumer written with another Kafka client than ours reads what the relay produced:
aiokafka (pure Python, its own protocol implementation) sees the key, the value, every header,
the ``event-id`` and the ``traceparent`` byte-exact."""

from __future__ import annotations

import asyncio

import psycopg

import outbox
from outbox.relay.config import RelayConfig
from tests.helpers import count, running_relay, wait_for

TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


async def _read(
    bootstrap: str, topic: str, expected: int
) -> list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]]:
    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    try:
        partitions = consumer.partitions_for_topic(topic) or set()
        for _ in range(50):
            if partitions:
                break
            await consumer.force_metadata_update()
            await asyncio.sleep(0.1)
            partitions = consumer.partitions_for_topic(topic) or set()
        assignment = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(assignment)
        await consumer.seek_to_beginning(*assignment)
        out: list[tuple[bytes | None, bytes, list[tuple[str, bytes]]]] = []
        deadline = asyncio.get_running_loop().time() + 30
        while len(out) < expected and asyncio.get_running_loop().time() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for records in batch.values():
                out.extend((r.key, r.value, list(r.headers)) for r in records)
        return out
    finally:
        await consumer.stop()


def test_aiokafka_reads_key_value_and_headers_byte_exact(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        ids = [
            outbox.enqueue(
                conn,
                topic,
                {"order": 1, "note": "café"},
                key="customer-7",
                headers={"traceparent": TRACEPARENT, "tenant": "acme", "sig": b"\xff\x00\x01"},
                schema=schema,
            ),
            outbox.enqueue(conn, topic, b"\x00raw\xff", key=b"\x01\x02", schema=schema),
        ]
        conn.commit()
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1)
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "delivered") == 2, timeout=30, what="delivery")
    records = asyncio.run(_read(kafka, topic, 2))
    assert len(records) == 2
    by_id = {dict(h)["event-id"].decode(): (k, v, h) for k, v, h in records}
    assert set(by_id) == {str(i) for i in ids}
    key, value, headers = by_id[str(ids[0])]
    assert key == b"customer-7"
    assert value == '{"order":1,"note":"café"}'.encode()
    assert dict(headers) == {
        "traceparent": TRACEPARENT.encode(),
        "tenant": b"acme",
        "sig": b"\xff\x00\x01",
        "content-type": b"application/json",
        "event-id": str(ids[0]).encode(),
    }
    key, value, headers = by_id[str(ids[1])]
    assert (key, value) == (b"\x01\x02", b"\x00raw\xff")
    assert dict(headers) == {"event-id": str(ids[1]).encode()}
