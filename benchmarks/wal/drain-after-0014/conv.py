import time, uuid, json, os
import psycopg
from psycopg._queries import PostgresQuery
from psycopg.adapt import Transformer
from outbox.queries import query
from outbox.batch import WalBatch, _column
from outbox.bench.events import *  # noqa
conn = psycopg.connect("postgresql://root@127.0.0.1:5432/test")
rows = []
for i in range(1000):
    hdr = json.dumps({"traceparent": f"00-{os.urandom(16).hex()}-{os.urandom(8).hex()}-01", "content-type": "application/json", "source": "orders-svc"})
    rows.append((i, str(uuid.uuid4()), "orders.placed", f"customer-{i%500}".encode(), json.dumps({"order": i, "items": [{"sku": "x"*10, "qty": 2}]*3}).encode(), hdr, time.time(), 0, None, None))
q = query("wal_archive", "outbox")
def old_cols(rows):
    return {"event_ids": _column(rows, 1), "topics": _column(rows, 2), "keys": _column(rows, 3), "payloads": _column(rows, 4),
            "headers": _column(rows, 5), "created": _column(rows, 6), "types": _column(rows, 8), "subjects": _column(rows, 9)}
extra = {"schema": "outbox", "partitions": "{}", "offsets": "{}", "refs": []}
for name, cols in (("old", lambda: old_cols(rows)), ("new", lambda: WalBatch._columns(rows, conn.info.encoding)), ("old", lambda: old_cols(rows)), ("new", lambda: WalBatch._columns(rows, conn.info.encoding))):
    t = time.perf_counter()
    for _ in range(50):
        p = PostgresQuery(Transformer(conn))
        p.convert(q, {**cols(), **extra})
    print(name, round((time.perf_counter() - t) / 50 / 1000 * 1e6, 2), "us per event")
