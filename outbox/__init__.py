"""outbox: a transactional outbox for PostgreSQL, and the relay that delivers it to brokers and webhooks.

Write side:

    with conn.transaction():
        conn.execute("INSERT INTO orders ...")
        outbox.enqueue(conn, "orders", {"id": 42}, key="customer-7")

Relay side: ``outbox relay --dsn ... --kafka-bootstrap ...``.

Consumer side (the effect once per event):

    with conn.transaction():
        if outbox.inbox.first_delivery(conn, "billing", event_id):
            charge(conn, order)
"""

from outbox import inbox
from outbox._version import __version__
from outbox.events import EVENT_ID_HEADER
from outbox.relay.retry import RetryPolicy
from outbox.transform.event import Event
from outbox.write.writer import enqueue, enqueue_async, enqueue_many, enqueue_many_async

# In the order the API reference shows them.
__all__ = [  # noqa: RUF022
    "enqueue",
    "enqueue_many",
    "enqueue_async",
    "enqueue_many_async",
    "EVENT_ID_HEADER",
    "RetryPolicy",
    "Event",
    "inbox",
    "__version__",
]
