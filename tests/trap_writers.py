"""Every writer stack and the inbox, as an application drives them, in a process of its own (Django
is configured once per process), for tests/acceptance/test_search_path_traps.py:

    python -m tests.trap_writers WRITER_DSN CONSUMER_DSN SCHEMA [SCHEMA ...]

For each schema (an outbox in table capture, one in WAL capture) and each stack: ``enqueue`` and
``enqueue_many`` (with a delay, and without: the COPY path) in a committed transaction, on
``WRITER_DSN``; the inbox's ``first_delivery`` on each stack's session of ``CONSUMER_DSN``.
Prints how many events it wrote; any error fails the process.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from typing import Any

from outbox_bench.writers import configure_django

import outbox
from tests.stacks import ASYNC_STACKS, SYNC_STACKS, AsyncStack, SyncStack

TOPIC = "orders.placed"


def _events(stack: str, delay: float | None) -> list[dict[str, Any]]:
    return [
        {"topic": TOPIC, "payload": {"stack": stack, "i": i}, "key": f"k{i}", "delay": delay}
        for i in range(3)
    ]


def sync_stacks(writer: str, consumer: str, schemas: list[str]) -> int:
    written = 0
    for name in SYNC_STACKS:
        for dsn, role in ((writer, "writer"), (consumer, "consumer")):
            if name == "django" and role == "consumer":
                continue  # Django holds one database connection a process: the writer's
            stack = SyncStack(name, dsn)
            try:
                for schema in schemas:
                    with stack.tx() as conn:
                        if role == "writer":
                            outbox.enqueue(conn, TOPIC, {"stack": name}, key="k", schema=schema)
                            outbox.enqueue_many(conn, _events(name, 0.5), schema=schema)
                            outbox.enqueue_many(conn, _events(name, None), schema=schema)
                            written += 7
                        elif schema == schemas[0]:
                            assert outbox.inbox.first_delivery(conn, name, uuid.uuid4(), schema=schema)
            finally:
                stack.close()
    return written


async def async_stacks(writer: str, consumer: str, schemas: list[str]) -> int:
    written = 0
    for name in ASYNC_STACKS:
        for dsn, role in ((writer, "writer"), (consumer, "consumer")):
            stack = AsyncStack(name, dsn)
            async with stack.connection() as conn:
                for schema in schemas:
                    async with stack.tx(conn) as tx:
                        if role == "writer":
                            await outbox.enqueue_async(tx, TOPIC, {"stack": name}, key="k", schema=schema)
                            await outbox.enqueue_many_async(tx, _events(name, 0.5), schema=schema)
                            await outbox.enqueue_many_async(tx, _events(name, None), schema=schema)
                            written += 7
                        elif schema == schemas[0]:
                            event = uuid.uuid4()
                            assert await outbox.inbox.first_delivery_async(tx, name, event, schema=schema)
    return written


def main() -> None:
    writer, consumer, *schemas = sys.argv[1:]
    configure_django(writer, INSTALLED_APPS=["outbox.contrib.django"])
    written = sync_stacks(writer, consumer, schemas) + asyncio.run(async_stacks(writer, consumer, schemas))
    print(written)


if __name__ == "__main__":
    main()
