"""outbox: a transactional outbox relay from PostgreSQL to Kafka.

Write side::

    with conn.transaction():
        conn.execute("INSERT INTO orders ...")
        outbox.enqueue(conn, "orders", {"id": 42}, key="customer-7")

Relay side: ``outbox relay --dsn ... --kafka-bootstrap ...``.

Consumer side (the effect once per event)::

    with conn.transaction():
        if outbox.inbox.first_delivery(conn, "billing", event_id):
            charge(conn, order)
"""

from importlib import metadata as _metadata

from outbox import inbox
from outbox.events import EVENT_ID_HEADER
from outbox.retry import RetryPolicy
from outbox.writer import enqueue, enqueue_async, enqueue_many, enqueue_many_async

__all__ = [
    "EVENT_ID_HEADER",
    "RetryPolicy",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "enqueue_many_async",
    "inbox",
]
try:
    __version__ = _metadata.version("outbox")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "unknown"
