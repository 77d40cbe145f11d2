"""Python peers in the drain, on the same events and the same broker (``outbox-relay-bench[peers]``).

- ``txoutbox`` (PyPI): an asyncio relay over the user's table and publisher
  function. Its PostgreSQL storage (asyncpg) claims with ``FOR UPDATE SKIP
  LOCKED`` and a lease, publishes each key's messages one after another (10
  keys at a time, 50 rows per round: its defaults), and acks by setting
  ``status = 'done'`` in place (rows stay in the table; no archive table).
  Strict ordering (its default: an advisory lock per claim and a ``NOT EXISTS``
  over earlier pending rows of the key) is compared with our default, non-strict
  with ``--ordering none``. The publisher is the one a user writes for it:
  confluent-kafka with the same producer settings as every contender here
  (idempotent, ``acks=all``), each publish awaited on its delivery report.
- ``faststream-outbox`` (PyPI): a FastStream broker whose subscriber reads the
  outbox table, relayed with FastStream's Kafka publisher (aiokafka) as its
  README shows (a stacked ``@publisher`` over ``@subscriber``), ``acks="all"``.
  Not idempotent: aiokafka's idempotent producer fails against the Tansu broker
  here (``UnknownError`` in the produce response), while confluent-kafka's works.
  It has no key and no per-key order, and deletes each row after its handler;
  compared with ``--ordering none``. Its per-message INFO logging is switched off
  (``logger=None``).

Each peer writes its own table through its own API (txoutbox ``insert``;
faststream-outbox ``publish_batch``, 1,000 rows per call sharing one set of
headers, so its ``traceparent`` repeats per 1,000 events) with the same JSON
orders, keys and headers as :mod:`outbox_bench.events`. Peers drain for a fixed
time (they are slow); their rate is the same middle 80 % of what they moved.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any

from outbox.observe.progress import Progress
from outbox_bench.contenders import PRODUCER_CONFIG, ContenderSpec
from outbox_bench.events import FILL_CHUNK, KEYS, order, trace_headers
from outbox_bench.writers import sqlalchemy_url

TX_TABLE = "tx_outbox"
FS_TABLE = "fs_outbox"
FS_QUEUE = "orders_outbox"
PEERS = {
    # name: (kind, options, compared with)
    "txoutbox": ("txoutbox", {"strict": True}, "relay"),
    "txoutbox_unordered": ("txoutbox", {"strict": False}, "relay_unordered"),
    "faststream_outbox": ("faststream", {}, "relay_unordered"),
}


def _headers(i: int) -> dict[str, str]:
    return {"content-type": "application/json", **trace_headers(i)}


# -- txoutbox ------------------------------------------------------------------------------


async def _tx_storage(dsn: str, schema: str, strict: bool) -> Any:
    from txoutbox.adapters.postgres import PostgresStorage

    return await PostgresStorage.connect(
        sqlalchemy_url(dsn, ""), schema=schema, table=TX_TABLE, strict_ordering=strict
    )


def tx_fill(dsn: str, schema: str, topic: str, n: int, label: str) -> None:
    async def fill() -> None:
        storage = await _tx_storage(dsn, schema, True)
        progress = Progress(f"fill {label}", n, " ev")
        try:
            await storage.create_schema()
            for start in range(0, n, FILL_CHUNK):
                end = min(n, start + FILL_CHUNK)
                async with storage.pool.acquire() as conn, conn.transaction():
                    for i in range(start, end):
                        await storage.insert(
                            conn, topic, order(i), key=f"customer-{i % KEYS}", headers=_headers(i)
                        )
                progress.update(end)
        finally:
            progress.close()
            await storage.close()

    asyncio.run(fill())


def tx_contender(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    dsn, schema, bootstrap, strict = spec.dsn, spec.schema, spec.bootstrap, bool(spec.relay_options["strict"])
    from confluent_kafka import KafkaException, Producer
    from txoutbox import Hooks, OutboxMessage, Relay

    class Counting(Hooks):
        async def on_round(self, result: Any, duration: float) -> None:
            counter.value += result.published

    async def main() -> None:
        loop = asyncio.get_running_loop()
        producer = Producer({"bootstrap.servers": bootstrap, **PRODUCER_CONFIG})
        polling = threading.Event()

        def poll() -> None:
            while not polling.is_set():
                producer.poll(0.05)

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()

        async def publish(message: OutboxMessage) -> None:
            done: asyncio.Future[None] = loop.create_future()

            def settle(err: Any, _msg: Any) -> None:
                def set_it() -> None:
                    if done.done():
                        return
                    if err is None:
                        done.set_result(None)
                    else:
                        done.set_exception(KafkaException(err))

                loop.call_soon_threadsafe(set_it)

            headers: list[tuple[str, str | bytes | None]] = [*message.headers.items()]
            headers.append(("event-id", str(message.id)))
            key = message.key.encode() if message.key else None
            producer.produce(
                message.topic, value=message.payload, key=key, headers=headers, on_delivery=settle
            )
            await done

        storage = await _tx_storage(dsn, schema, strict)
        relay = Relay(storage, publish, hooks=Counting())
        task = asyncio.create_task(relay.run())
        while not stop.is_set():
            await asyncio.sleep(0.05)
        relay.stop()
        await task
        polling.set()
        producer.flush(10)
        await storage.close()

    asyncio.run(main())


# -- faststream-outbox -----------------------------------------------------------------------


def _quiet() -> None:
    logging.getLogger("alembic").setLevel(logging.WARNING)  # faststream-outbox imports it


def _fs_table(schema: str) -> Any:
    _quiet()
    from faststream_outbox import make_outbox_table
    from sqlalchemy import MetaData

    return make_outbox_table(MetaData(schema=schema), table_name=FS_TABLE)


def fs_fill(dsn: str, schema: str, n: int, label: str) -> None:
    _quiet()
    from faststream_outbox import OutboxBroker
    from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

    async def fill() -> None:
        engine = create_async_engine(sqlalchemy_url(dsn, "asyncpg"))
        table = _fs_table(schema)
        broker = OutboxBroker(engine, outbox_table=table)
        progress = Progress(f"fill {label}", n, " ev")
        try:
            async with engine.begin() as conn:
                await conn.run_sync(table.metadata.create_all)
            for start in range(0, n, 1000):
                end = min(n, start + 1000)
                async with AsyncSession(engine) as session, session.begin():
                    bodies = [order(i) for i in range(start, end)]
                    await broker.publish_batch(
                        *bodies, queue=FS_QUEUE, session=session, headers=_headers(start)
                    )
                progress.update(end)
        finally:
            progress.close()
            await engine.dispose()

    asyncio.run(fill())


def fs_contender(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    dsn, schema, bootstrap, topic = spec.dsn, spec.schema, spec.bootstrap, spec.topic
    _quiet()
    from faststream.kafka import KafkaBroker
    from faststream_outbox import OutboxBroker
    from sqlalchemy.ext.asyncio import create_async_engine

    async def main() -> None:
        engine = create_async_engine(sqlalchemy_url(dsn, "asyncpg"))
        # logger=None: FastStream logs every message at INFO by default (two lines per event
        # to stdout), a cost no deployment at this rate would keep.
        outbox = OutboxBroker(engine, outbox_table=_fs_table(schema), logger=None)
        kafka = KafkaBroker(bootstrap, acks="all", logger=None)
        to_kafka = kafka.publisher(topic)

        @to_kafka
        @outbox.subscriber(FS_QUEUE)
        async def relay(body: dict[str, Any]) -> dict[str, Any]:
            # Counted when the handler runs, just before FastStream publishes its result:
            # a few milliseconds early, in the peer's favour.
            counter.value += 1
            return body

        await kafka.start()
        await outbox.start()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await outbox.stop()
        await kafka.stop()
        await engine.dispose()

    asyncio.run(main())
