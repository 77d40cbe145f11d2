"""A/B: drain 100k realistic events with `outbox relay` of two checkouts, interleaved; wall and CPU."""
import os, subprocess, sys, time, resource, statistics, psycopg, uuid, json
sys.path.insert(0, "/work/main")
from outbox.harness.embedded import Broker
from outbox.write.writer import enqueue_many
DSN = "postgresql://root@127.0.0.1:5432/test"
PY = "/work/main/.venv/bin/python"
broker = Broker().start()
results = {"before": [], "after": []}
def fill(schema):
    with psycopg.connect(DSN, autocommit=True) as a:
        a.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    subprocess.run([PY, "-m", "outbox", "migrate", "--dsn", DSN, "--schema", schema], check=True, capture_output=True, cwd="/work/main")
    with psycopg.connect(DSN, autocommit=True) as a:
        a.execute(f"ALTER TABLE {schema}.events SET (autovacuum_enabled = false)")
    with psycopg.connect(DSN) as conn:
        for start in range(0, 200_000, 10_000):
            enqueue_many(conn, [{"topic": f"orders.{i%4}", "key": f"customer-{i % 5000}", "payload": {"order_id": str(uuid.uuid4()), "lines": [{"sku": "A-1", "qty": 2, "price": "19.99"}] * 3, "note": "x" * 120}, "headers": {"traceparent": "00-" + "a"*32 + "-" + "b"*16 + "-01", "source": "shop"}} for i in range(start, start + 10_000)], schema=schema)
            conn.commit()
def pending(schema):
    with psycopg.connect(DSN) as c:
        return c.execute(f"SELECT count(*) FROM {schema}.events").fetchone()[0]
for rep in range(8):
    for side, cwd in (("before", "/tmp/before"), ("after", "/work/main")) if rep % 2 == 0 else (("after", "/work/main"), ("before", "/tmp/before")):
        schema = f"ab_{side}"
        fill(schema)
        t0 = time.monotonic()
        p = subprocess.Popen([PY, "-m", "outbox", "relay", "--dsn", DSN, "--schema", schema, "--kafka-bootstrap", broker.bootstrap], cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while pending(schema) > 0:
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"relay {side} exited or stalled: {p.poll()}")
            time.sleep(0.05)
        wall = time.monotonic() - t0
        with open(f"/proc/{p.pid}/stat") as f:
            parts = f.read().split(")")[1].split()
        cpu = (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
        p.terminate(); p.wait()
        results[side].append((round(wall, 2), round(cpu, 2)))
        print(side, rep, "wall", round(wall, 2), "cpu", round(cpu, 2), flush=True)
broker.stop()
for side, r in results.items():
    print(side, "median wall", statistics.median(w for w, _ in r), "median cpu", statistics.median(c for _, c in r))
