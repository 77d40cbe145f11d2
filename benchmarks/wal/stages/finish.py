"""WAL capture's batch finish (archive, positions, commit) alone, and without its parts.

Usage: python finish.py [N]  (the machine's PostgreSQL; makes and drops the outbox fin_bench,
its slot and publication). Batches of 7 realistic events, all delivered, as the steady bench's;
4 interleaved rounds of N finishes per variant; prints the p50 and mean of each.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import uuid
from typing import Any

import psycopg
import psycopg.sql

from outbox import batch, capture
from outbox.queries import int_array, query
from outbox.retry import RetryPolicy
from outbox.sinks.base import Delivered

DSN = "host=127.0.0.1 dbname=test user=root"
SCHEMA = "fin_bench"
EVENTS = 7
PAYLOAD = json.dumps({"order": 1, "items": [{"sku": "x" * 8, "qty": 2}] * 5}).encode()
HEADERS = json.dumps({"traceparent": f"00-{'1' * 32}-{'2' * 16}-01", "content-type": "application/json"})
_write = batch.WalBatch._write


def rows() -> list[tuple[Any, ...]]:
    now = time.time()
    return [
        (0, str(uuid.uuid4()), "orders", b"key-%d" % i, PAYLOAD, HEADERS, now, 0, "t", "s")
        for i in range(EVENTS)
    ]


def archive_only(self: batch.WalBatch, schema: str, w: Any) -> None:
    """The finish without the position statements (for the measurement only)."""
    ok = [self.rows[i] for i in w.ok_ids]
    params = {"partitions": int_array(w.ok_parts), "offsets": int_array(w.ok_offsets), "refs": []}
    self.conn.execute(query("wal_archive", schema), {"schema": schema, **self._columns(ok), **params})


def finish(conn: psycopg.Connection[Any], lsn: int) -> float:
    b = batch.WalBatch(conn, rows(), capture.Position(lsn))
    for i in range(EVENTS):
        b.outcomes[i] = Delivered(0, i, None)
    start = time.perf_counter()
    b.finish(SCHEMA, RetryPolicy(), archive=True, latencies=False)
    return (time.perf_counter() - start) * 1000


def empty(conn: psycopg.Connection[Any], _lsn: int) -> float:
    start = time.perf_counter()
    conn.execute("SELECT 1")
    conn.commit()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 500
    migrate = [
        sys.executable,
        "-m",
        "outbox",
        "migrate",
        "--dsn",
        DSN,
        "--schema",
        SCHEMA,
        "--capture",
        "wal",
    ]
    subprocess.run(migrate, check=True, capture_output=True)
    variants = {"as shipped": finish, "no position statements": finish, "no pipeline": finish, "empty": empty}
    times: dict[str, list[float]] = {v: [] for v in variants}
    lsn = 1 << 24
    try:
        with psycopg.connect(DSN) as conn:
            for _ in range(4):
                for name, run in variants.items():
                    batch.WalBatch._write = archive_only if name == "no position statements" else _write  # type: ignore[method-assign]
                    batch.PIPELINE = name != "no pipeline"
                    for _ in range(n):
                        lsn += 1000
                        times[name].append(run(conn, lsn))
    finally:
        back = [*migrate[:-1], "table", "--drop-slot"]  # the slot and publication go
        subprocess.run(back, check=True, capture_output=True)
        with psycopg.connect(DSN, autocommit=True) as conn:
            conn.execute(psycopg.sql.SQL("DROP SCHEMA {} CASCADE").format(psycopg.sql.Identifier(SCHEMA)))
    for name, xs in times.items():
        print(f"{name:<24} p50 {statistics.median(xs):.3f} ms, mean {statistics.mean(xs):.3f} ms ({len(xs)})")


if __name__ == "__main__":
    main()
