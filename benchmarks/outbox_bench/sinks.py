"""The ``sinks`` scenario: a drain of each sink beyond Kafka, next to a minimal loop for that sink.

For each sink (RabbitMQ, NATS JetStream, Redis Streams, webhooks), the same events
(:mod:`outbox_bench.events`: JSON orders with ``content-type``, ``traceparent`` and
``tracestate``, 1,000 keys; no VACUUM or ANALYZE after the fill) are drained twice per
repeat, in child processes, interleaved:

- ``relay``: this project's relay with its defaults (ordering on, archive on), one route
  ``*=URL``;
- ``loop``: the minimal loop for that sink, written the way a careful hand-written
  relay would be: lock 1,000 rows with SKIP LOCKED, publish all of them at once with the
  sink's confirmation (publisher confirms; JetStream async publish acks; one pipeline of
  ``XADD``; concurrent POSTs), delete + archive in one statement, commit; two such workers
  at once on their own connections, as the relay has two batches out. Same client library,
  same message, no ordering, retries, leases or telemetry.

The webhook receiver runs in a process of its own (asyncio, 204 to everything).
Reported: median events/s over the repeats, and the same-run ratio relay / loop.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import time
import uuid
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any, cast

import psycopg

from outbox.observe.progress import Progress
from outbox.relay.config import MAX_BATCHES_IN_FLIGHT, RelayConfig
from outbox.relay.relay import Relay
from outbox.sinks.make import routed
from outbox.sinks.routes import parse_routes
from outbox.store.migrate import migrate
from outbox_bench.config import BenchConfig
from outbox_bench.contenders import Contender, ContenderSpec, drive
from outbox_bench.events import fill
from outbox_bench.harness.sinktaps import Receiver, SinkTap
from outbox_bench.harness.taps import tap_class
from outbox_bench.measure import median, middle_rate, race
from outbox_bench.queries import query

LOOP_BATCH = 1000
FLIGHTS = MAX_BATCHES_IN_FLIGHT  # the loop's batches out at once: the relay's default
# Read as they arrive: through an SQS queue (SNS and EventBridge: subscribed), or a Pub/Sub
# subscription (the emulator keeps what no one acknowledged).
QUEUE_BACKED = ("sqs", "sns", "eventbridge", "pubsub")


# -- the webhook receiver, in its own process ---------------------------------------------


def _receiver_proc(port: Synchronized[int], stop: Event) -> None:
    receiver = Receiver(keep=False)
    port.value = receiver.port
    stop.wait()
    receiver.close()


class Destination:
    """One sink's destination for one drain: made before, removed after."""

    def __init__(self, sink: str, topic: str) -> None:
        self.sink = sink
        self.tap: SinkTap | None = None
        self._proc: Any = None
        if sink == "http":
            ctx = mp.get_context("spawn")
            port, self._stop = ctx.Value("i", 0), ctx.Event()
            self._proc = ctx.Process(target=_receiver_proc, args=(port, self._stop), daemon=True)
            self._proc.start()
            while port.value == 0 and self._proc.is_alive():
                time.sleep(0.05)
            self.url = f"http://127.0.0.1:{port.value}/hooks/{{topic}}"
        else:
            self.tap = tap_class(sink)(sink, topic)
            self.tap.setup()
            self.url = self.tap.route(*self.tap.server)  # straight to the server, to its own destination
            if self.scheme in QUEUE_BACKED:
                # A queue in use has a consumer: read and deleted as it fills, as the fault
                # harness does. moto's SQS answers more slowly the more a queue holds (a send at
                # 3,000 queued took about half a second), which an undrained queue would measure.
                self.tap.start()
                self.tap.ready.wait(10)

    @property
    def scheme(self) -> str:
        return "http" if self.sink == "http" else self.url.split("://")[0]

    def close(self) -> None:
        if self.tap is not None:
            if self.tap.is_alive():
                self.tap.stop_event.set()
                self.tap.join(30)
            self.tap.teardown()
        if self._proc is not None:
            self._stop.set()
            self._proc.join(10)


# -- contenders (child processes) ------------------------------------------------------------


def relay_contender(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    config = RelayConfig(spec.dsn, schema=spec.schema)
    drive(
        Relay(config, routed(parse_routes([f"*={spec.sink_url}"], None), config.delivery_timeout)),
        counter,
        stop,
    )


def loop_contender(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    asyncio.run(_loop(spec.dsn, spec.schema, spec.sink_url, counter, stop))


def _text_headers(event_id: str, key: bytes | None, headers: dict[str, str] | None) -> dict[str, str]:
    out = dict(headers or {})
    out["event-id"] = event_id
    if key is not None:
        out["event-key"] = key.decode()
    return out


async def _loop(dsn: str, schema: str, url: str, counter: Synchronized[int], stop: Event) -> None:
    """FLIGHTS workers, each on its own connection: claim, publish and confirm, archive, commit.
    SKIP LOCKED keeps their batches apart, so one publishes while the other claims or archives:
    the relay's two batches in flight, written the way an asyncio program would."""
    scheme = url.split("://")[0]
    publish, close = await _publisher(scheme, url)
    claim = query("sink_loop_claim", schema)
    archive = query("archive_delivered", schema)
    moved = 0

    async def worker() -> None:
        nonlocal moved
        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            while not stop.is_set():
                rows = await (await conn.execute(claim, {"limit": LOOP_BATCH})).fetchall()
                if not rows:
                    await conn.rollback()
                    await asyncio.sleep(0.005)
                    continue
                await publish(rows)
                ids = [r[0] for r in rows]
                nulls = [None] * len(ids)
                await conn.execute(
                    archive,
                    {"ids": ids, "partitions": nulls, "offsets": nulls, "refs": nulls, "filtered": []},
                )
                await conn.commit()
                moved += len(rows)
                counter.value = moved

    try:
        await asyncio.gather(*(worker() for _ in range(FLIGHTS)))
    finally:
        await close()


async def _publisher(scheme: str, url: str) -> Any:
    """(``publish(rows)``: every row sent and confirmed by the sink, or an exception; ``close()``)."""
    if scheme == "amqp":
        import aiormq
        from pamqp import commands as spec

        exchange = url.split("exchange=")[1].split("&")[0]
        connection = await aiormq.connect(url.split("?")[0])
        # The concrete channel: its basic_publish takes wait=False (the abstract one does not say).
        channel = cast(
            aiormq.Channel, await connection.channel(publisher_confirms=True, on_return_raises=True)
        )

        async def amqp(rows: list[Any]) -> None:
            await asyncio.gather(
                *(
                    channel.basic_publish(
                        payload,
                        exchange=exchange,
                        routing_key=topic,
                        mandatory=True,
                        wait=False,
                        properties=spec.Basic.Properties(
                            message_id=str(event_id),
                            delivery_mode=2,
                            content_type=(headers or {}).get("content-type"),
                            headers=dict(_text_headers(str(event_id), key, headers)),
                        ),
                    )
                    for _id, event_id, topic, key, payload, headers in rows
                )
            )

        return amqp, connection.close
    if scheme == "nats":
        import nats

        nc = await nats.connect(url)
        js = nc.jetstream(publish_async_max_pending=LOOP_BATCH * FLIGHTS)

        async def jetstream(rows: list[Any]) -> None:
            futures = []
            for _id, event_id, topic, key, payload, headers in rows:
                h = _text_headers(str(event_id), key, headers)
                h["Nats-Msg-Id"] = str(event_id)
                futures.append(await js.publish_async(topic, payload, headers=h))
            await asyncio.gather(*futures)

        return jetstream, nc.close
    if scheme == "redis":
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(url)

        async def xadd(rows: list[Any]) -> None:
            pipe = client.pipeline(transaction=False)
            for _id, event_id, topic, key, payload, headers in rows:
                fields: dict[Any, Any] = {"event-id": str(event_id), "key": key, "payload": payload}
                if headers:
                    fields["headers"] = json.dumps(headers, separators=(",", ":"))
                pipe.xadd(topic, fields)
            await pipe.execute()

        return xadd, client.aclose
    if scheme in ("sqs", "sns", "eventbridge", "kinesis"):
        return await _aws_publisher(scheme, url)
    if scheme == "pubsub":
        return _pubsub_publisher(url)
    import aiohttp

    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=100))

    async def post(row: Any) -> None:
        _id, event_id, topic, key, payload, headers = row
        h = _text_headers(str(event_id), key, headers)
        async with session.post(url.replace("{topic}", topic), data=payload, headers=h) as response:
            if response.status >= 300:
                raise RuntimeError(f"HTTP {response.status}")

    async def webhooks(rows: list[Any]) -> None:
        await asyncio.gather(*(post(row) for row in rows))

    return webhooks, session.close


def _pubsub_publisher(url: str) -> Any:
    """The minimal loop on Pub/Sub: Google's publisher, as the relay uses it, with ordering keys
    (the relay's per-key order needs them; without, the loop would not be sending the same
    thing), every row of the batch published, then every future awaited. The same message:
    the payload as data, ``event-id`` and the headers as attributes, the key as ordering key."""
    from google.cloud import pubsub_v1

    from outbox.sinks.routes import parse_url

    parsed = parse_url(url, "--sinks")
    path = f"projects/{parsed.parts.netloc}/topics/{parsed.parts.path.strip('/')}"
    client = pubsub_v1.PublisherClient(
        publisher_options=pubsub_v1.types.PublisherOptions(enable_message_ordering=True)
    )

    async def publish(rows: list[Any]) -> None:
        futures = [
            client.publish(
                path,
                payload,
                ordering_key=(key or b"").decode(),
                **_text_headers(str(event_id), None, headers),
            )
            for _id, event_id, _topic, key, payload, headers in rows
        ]
        await asyncio.gather(*(asyncio.wrap_future(f) for f in futures))

    async def close() -> None:
        await asyncio.to_thread(client.stop)

    return publish, close


async def _aws_publisher(scheme: str, url: str) -> Any:
    """The minimal loop on AWS: the same client as the relay (aiobotocore), every batch call of
    the 1,000 rows in flight at once, an entry the service refused is an exception. The message
    is the relay's: the payload as the body, ``event-id``/``event-key`` and the headers as
    attributes (SQS, SNS), the id in ``Resources`` (EventBridge), the key as the partition key
    and the same JSON envelope when the route asks for one (Kinesis)."""
    import aiobotocore.session

    from outbox.sinks.routes import parse_url

    parsed = parse_url(url, "--sinks")
    name, options = parsed.resource, parsed.options
    context = aiobotocore.session.get_session().create_client(
        {"eventbridge": "events"}.get(scheme, scheme),
        region_name=options.get("region") or "us-east-1",
        endpoint_url=options.get("endpoint"),
    )
    client = await context.__aenter__()

    async def close() -> None:
        await context.__aexit__(None, None, None)

    def attributes(event_id: str, key: bytes | None, headers: dict[str, str] | None) -> dict[str, Any]:
        return {
            k: {"DataType": "String", "StringValue": v}
            for k, v in _text_headers(event_id, key, headers).items()
        }

    async def in_batches(rows: list[Any], size: int, call: Any) -> None:
        answers = await asyncio.gather(*(call(rows[i : i + size]) for i in range(0, len(rows), size)))
        for answer in answers:
            failed = answer.get("Failed") or answer.get("FailedEntryCount") or answer.get("FailedRecordCount")
            if failed:
                raise RuntimeError(f"{scheme}: refused: {failed}")

    if scheme in ("sqs", "sns"):
        if scheme == "sqs":
            queue_url = (await client.get_queue_url(QueueName=name))["QueueUrl"]
            body = "MessageBody"

            async def call(entries: list[Any]) -> Any:
                return await client.send_message_batch(QueueUrl=queue_url, Entries=entries)
        else:
            topic_arn = (await client.create_topic(Name=name))["TopicArn"]  # the existing topic's ARN
            body = "Message"

            async def call(entries: list[Any]) -> Any:
                return await client.publish_batch(TopicArn=topic_arn, PublishBatchRequestEntries=entries)

        async def send(batch: list[Any]) -> Any:
            return await call(
                [
                    {"Id": str(i), body: payload.decode(), "MessageAttributes": attributes(str(e), k, h)}
                    for i, (_id, e, _topic, k, payload, h) in enumerate(batch)
                ]
            )

        return (lambda rows: in_batches(rows, 10, send)), close
    if scheme == "eventbridge":
        source = options.get("source") or "outbox-bench"

        async def put_events(batch: list[Any]) -> Any:
            entries = [
                {
                    "Source": source,
                    "DetailType": topic,
                    "Detail": payload.decode(),
                    "EventBusName": name,
                    "Resources": [f"urn:uuid:{e}"],
                }
                for _id, e, topic, _k, payload, _h in batch
            ]
            return await client.put_events(Entries=entries)

        return (lambda rows: in_batches(rows, 10, put_events)), close
    envelope = options.get("envelope") == "json"

    def data(event_id: str, topic: str, key: bytes | None, payload: bytes, headers: Any) -> bytes:
        if not envelope:
            return payload
        out = {"id": event_id, "topic": topic, "key": key and key.decode(), "headers": headers or {}}
        out["payload"] = json.loads(payload)
        return json.dumps(out, separators=(",", ":")).encode()

    async def put_records(batch: list[Any]) -> Any:
        records = [
            {"Data": data(str(e), topic, k, payload, h), "PartitionKey": (k or b"").decode() or str(e)}
            for _id, e, topic, k, payload, h in batch
        ]
        return await client.put_records(StreamName=name, Records=records)

    return (lambda rows: in_batches(rows, 500, put_records)), close


# -- the scenario --------------------------------------------------------------------------


CONTENDERS: dict[str, Contender] = {"relay": relay_contender, "loop": loop_contender}


def drain_sink_once(dsn: str, sink: str, kind: str, n: int, run: int, max_seconds: float) -> dict[str, Any]:
    tag = uuid.uuid4().hex[:8]
    schema, topic = f"bench_sink_{kind}_{tag}", f"bench.sinks.{tag}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, schema)
    destination = Destination(sink, topic)
    label = f"{destination.scheme} {kind} #{run + 1}"
    try:
        fill(dsn, schema, topic, n, label)  # realistic events, no ANALYZE
        entry = CONTENDERS[kind]
        spec = ContenderSpec(f"sink_{kind}", dsn, schema, "", sink_url=destination.url, entry=entry)
        result = race(
            [spec],
            target=n,
            max_seconds=max_seconds,
            progress=Progress(f"drain {label}", n, " ev"),
        )
    finally:
        destination.close()
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(query("harness_drop_schema", schema))
    return {
        "events_per_s": round(middle_rate(result.series, n), 1),
        "cpu_s_per_1k": round(1000 * result.relay_cpu_s / max(result.moved, 1), 4),
        "moved": result.moved,
    }


def sinks(cfg: BenchConfig) -> dict[str, Any]:
    """Each sink of ``cfg.sinks``: relay and minimal loop, ``cfg.repeat`` times, interleaved."""
    out: dict[str, Any] = {"events": cfg.sink_events, "repeat": cfg.repeat, "sinks": {}}
    chosen = [url for item in cfg.sinks for url in item.split()]
    for sink in chosen:
        tap_class(sink)  # a bad URL or a missing extra: one line, before any work
    for sink in chosen:
        runs: dict[str, list[dict[str, Any]]] = {"relay": [], "loop": []}
        for run in range(cfg.repeat):
            for kind in runs:
                runs[kind].append(
                    drain_sink_once(cfg.dsn, sink, kind, cfg.sink_events, run, cfg.max_race_seconds)
                )
        relay = median([r["events_per_s"] for r in runs["relay"]])
        loop = median([r["events_per_s"] for r in runs["loop"]])
        scheme = "http" if sink == "http" else sink.split("://")[0]
        out["sinks"][scheme] = {
            "relay_events_per_s_median": round(relay, 1),
            "loop_events_per_s_median": round(loop, 1),
            "relay_runs": [r["events_per_s"] for r in runs["relay"]],
            "loop_runs": [r["events_per_s"] for r in runs["loop"]],
            "relay_cpu_s_per_1k": median([r["cpu_s_per_1k"] for r in runs["relay"]]),
            "loop_cpu_s_per_1k": median([r["cpu_s_per_1k"] for r in runs["loop"]]),
            "ratio_relay_to_loop": round(relay / max(loop, 1e-9), 3),
        }
    return out
