"""The events every drain fills with: what a traced application writes, through ``enqueue_many``.

``realistic``: an order as JSON (about 200 bytes, so the writer adds ``content-type:
application/json``), keyed by one of 1,000 customers, with the W3C ``traceparent`` and
``tracestate`` of the transaction that wrote it (a trace of its own per event, as an app
traced with OpenTelemetry writes them). ``bytes``: 200 opaque bytes, no headers, the same
keys (the shape the drain used before; a second row, not the default).

Nothing is vacuumed or analyzed after a fill: a backlog after an outage has no fresh
statistics. Variants that want them ask for them (``analyze=True``).
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import psycopg

from outbox.observe.progress import Progress
from outbox.write.writer import enqueue_many
from outbox_bench.queries import query

KEYS = 1000
FILL_CHUNK = 10_000  # events per enqueue_many/commit while filling
PAYLOAD_BYTES = 200  # the bytes shape
SHAPES = ("realistic", "bytes")
TRACESTATE = "congo=t61rcWkgMzE,rojo=00f067aa0ba902b7"


def order(i: int) -> dict[str, Any]:
    """Event ``i``'s payload: an order (about 200 bytes as compact JSON)."""
    return {
        "order_id": i,
        "customer": f"customer-{i % KEYS}",
        "status": "created",
        "placed_at": "2026-11-23T01:00:00.000Z",
        "items": [{"sku": f"sku-{i % 97}", "qty": 1 + i % 3, "price": "19.99"}],
        "total": "19.99",
        "currency": "EUR",
        "channel": "web",
    }


def trace_headers(i: int) -> dict[str, str]:
    """The trace context an instrumented writer would attach to event ``i``."""
    ids = hashlib.blake2b(i.to_bytes(8, "big"), digest_size=24).hexdigest()  # random-looking, repeatable
    return {"traceparent": f"00-{ids[:32]}-{ids[32:]}-01", "tracestate": TRACESTATE}


def realistic(i: int, topic: str) -> dict[str, Any]:
    return {"topic": topic, "key": f"customer-{i % KEYS}", "payload": order(i), "headers": trace_headers(i)}


def fill(
    dsn: str, schema: str, topic: str, n: int, label: str, *, shape: str = "realistic", analyze: bool = False
) -> float:
    """``n`` events of ``shape`` in ``schema``'s outbox, committed 10,000 at a time. Returns the
    CPU seconds its session's server process spent writing them (0.0 when the server is not a
    process of this machine): what writing costs the database, in table or WAL capture."""
    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {SHAPES}, got {shape!r}")
    progress = Progress(f"fill {label}", n, " ev")
    blob = bytes(random.getrandbits(8) for _ in range(PAYLOAD_BYTES))
    from outbox_bench.measure import backend_cpu  # psutil, as its runners

    with psycopg.connect(dsn) as conn:
        row = conn.execute(query("backend_pid", "public")).fetchone()
        conn.commit()
        backend = int(row[0]) if row else 0
        before = backend_cpu(backend)
        for start in range(0, n, FILL_CHUNK):
            end = min(n, start + FILL_CHUNK)
            if shape == "realistic":
                events = [realistic(i, topic) for i in range(start, end)]
            else:
                events = [
                    {"topic": topic, "key": f"customer-{i % KEYS}", "payload": blob}
                    for i in range(start, end)
                ]
            enqueue_many(conn, events, schema=schema)
            conn.commit()
            progress.update(end)
        spent = backend_cpu(backend) - before
        if analyze:
            conn.autocommit = True
            conn.execute(query("harness_analyze", schema))
    progress.close()
    return spent
