"""What the benchmark races: the relay and the two baselines, each in its own process.

Each contender runs in a child process (spawned, not forked: librdkafka and
psycopg hold threads and sockets) so that its CPU time and peak RSS are its
own. It reports the number of events it has moved through a shared counter and
stops when the parent sets ``stop``.

- ``relay``: this project's relay, default settings (archive on, ordering on).
- ``ceiling``: the minimal loop, on plain tables of its own (no generated
  column, no partitions, no trigger). Lock 2,000 rows (the relay's --batch-size)
  with SKIP LOCKED, produce each with its headers and ``event-id``; once their
  delivery reports are in, delete + archive in one statement and commit, on a
  finisher thread, while the next 2,000 are claimed on a second session (two
  batches out at most, the relay's default). No leases, retries, telemetry or
  ordering.
- ``bare``: the same loop on the outbox's own tables (generated partition
  column, partitioned archive): a second reference, not the ceiling.
- ``ceiling_wal``: the minimal loop of WAL capture. Stream the outbox's slot (psycopg2,
  pgoutput with ``messages``), produce each event of this outbox's prefix with its headers
  and ``event-id`` as it is read, and every 2,000 events (as the table's ceiling): once
  their reports are in, archive them into a plain table with one INSERT and commit, on a
  finisher thread (one: in order), while the next are read and produced; the slot is
  confirmed up to the last transaction read whole when the stream pauses. No ordering,
  retries, telemetry or exact resume: what reading the WAL can do at most here.
- ``steady_loop``: the minimal loop at steady load, the steady scenario's reference. LISTEN on
  the outbox's channel; claim up to 2,000 with SKIP LOCKED; produce each with its headers and
  ``event-id`` (``acks=all``), flush, archive with the relay's own statement, COMMIT; when the
  claim finds nothing, wait for a NOTIFY. One batch at a time: at a steady rate a batch is a
  handful of events, and a second one out would only wait behind the first.
- ``seeds``: the loop most teams start with. One row per transaction: claim,
  mark the lease, publish, flush, delete.
- ``txoutbox`` / ``faststream``: the Python peers (:mod:`outbox_bench.peers`).
- ``sink_relay`` / ``sink_loop``: the relay and the minimal loop for a sink beyond
  Kafka (:mod:`outbox_bench.sinks`).

Both ceilings overlap a batch's archive with the next batch and claim what the relay
claims, as the relay does: serial and 1,000 at a time, they fell to 0.74x the relay once it
finished its batches off its loop (2026-11-27), a ceiling no longer.

The peers and the sink contenders live in modules above this one: their specs carry
their own ``entry`` function, so this module (and :mod:`outbox_bench.measure`, which
spawns every contender) imports neither.
"""

from __future__ import annotations

import json
import os
import select
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Producer

from outbox import capture
from outbox.capture import wal_message
from outbox.events import EVENT_ID_HEADER, ClaimedEvent, MessageHeaders, decode_headers
from outbox.relay.config import BATCH_SIZE, MAX_BATCHES_IN_FLIGHT
from outbox.relay.relay import Relay, RelayConfig, tune_gc
from outbox.sinks.base import Delivered, Outcome, OutcomeSlots, Report, Settle, SinkWrapper
from outbox.sinks.kafka import KafkaSink, produce_each
from outbox.store.outboxes import Outbox
from outbox.store.schema import channel_name
from outbox_bench.queries import query

BARE_BATCH = BATCH_SIZE  # rows per batch of the minimal loops: the relay's default claim
IDLE_WAIT = 0.005  # seconds a baseline sleeps when it finds nothing to do
STEADY_IDLE_WAIT = 0.5  # seconds the steady loop waits for a NOTIFY before it claims again
REPORT_WAIT = 0.001  # seconds a minimal loop waits for a delivery report when it can do nothing else
FLIGHTS = MAX_BATCHES_IN_FLIGHT  # batches a minimal loop has out at once, as the relay by default
PRODUCER_CONFIG = {"enable.idempotence": True, "acks": "all", "linger.ms": 5}
DRIVE_EVERY = 0.05  # seconds between looks at the relay's delivered count, and at the stop
PARENT_CHECK = 0.5  # seconds between a contender's looks at whether the bench is still there


@dataclass
class ContenderSpec:
    # relay | steady_loop | ceiling | ceiling_wal | bare | seeds | txoutbox | faststream | sink_relay
    # | sink_loop
    kind: str
    dsn: str
    schema: str
    bootstrap: str
    relay_options: dict[str, Any] = field(default_factory=dict)
    sink_url: str = ""  # sink_relay / sink_loop: the route URL (outbox_bench.sinks)
    topic: str = ""  # faststream: the Kafka topic its publisher writes to
    ack_log: str | None = None  # steady scenario: where a contender writes event-id -> ack time
    ack_sample: bool = False  # keep the ack times of a sixteenth of the events (ack_sampled)
    schemas: list[str] = field(default_factory=list)  # tenants: every outbox one relay serves
    # The child's entry for the contenders defined above this module (peers, sinks); spawned
    # processes receive it by its qualified name.
    entry: Contender | None = None


Contender = Callable[[ContenderSpec, "Synchronized[int]", Event], None]


def ack_sampled(event_id: str) -> bool:
    """The sixteenth of the events whose ack time a long run keeps (by the id's last hex digit)."""
    return event_id.endswith("0")


def _every(_event_id: str) -> bool:
    return True


def _headers(event_id: Any, headers: Any) -> list[tuple[str, str | bytes | None]]:
    out: list[tuple[str, str | bytes | None]] = [
        (k, v.encode()) for k, v in (headers or {}).items() if isinstance(v, str)
    ]
    out.append(("event-id", str(event_id).encode()))
    return out


def _die_with_parent() -> None:
    """Exit when the bench that spawned this contender is gone (killed, not stopped): else the
    contender goes on, polling the database and skewing every later measurement."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK)
        os._exit(3)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def run_contender(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    """Child-process entry point: every contender with the garbage collector ``outbox relay`` sets."""
    _die_with_parent()
    tune_gc()
    if spec.entry is not None:
        spec.entry(spec, counter, stop)
    elif spec.kind == "relay":
        _relay(spec, counter, stop)
    elif spec.kind == "bare":
        _loop(spec, "bare_claim", "archive_delivered", counter, stop)
    elif spec.kind == "seeds":
        _seeds(spec, counter, stop)
    elif spec.kind == "ceiling":
        _loop(spec, "ceiling_claim", "ceiling_archive", counter, stop)
    elif spec.kind == "ceiling_wal":
        _wal_loop(spec, counter, stop)
    elif spec.kind == "steady_loop":
        _steady_loop(spec, counter, stop)
    else:
        raise ValueError(f"contender: unknown kind {spec.kind!r}")


class AckTimingSink(SinkWrapper):
    """The Kafka sink, recording when each event's ack arrived (steady scenario)."""

    def __init__(self, inner: KafkaSink, sample: bool = False) -> None:
        super().__init__(inner)
        self.acks: list[tuple[str, float]] = []
        self.keep: Callable[[str], bool] = ack_sampled if sample else _every

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        return self.inner.produce(event, self._timed(event, report))

    def produce_many(self, events: Sequence[ClaimedEvent], outcomes: OutcomeSlots, settle: Settle) -> int:
        """The relay's batch path, its deliveries timed as :meth:`produce` times one event's."""
        many = getattr(self.inner, "produce_many", None)
        if many is None:
            return 0
        return int(many(events, _TimedSlots(outcomes, events, self.acks, self.keep), settle))

    def _timed(self, event: ClaimedEvent, report: Report) -> Report:
        event_id = str(event.event_id)

        def timed(outcome: Outcome) -> None:
            if isinstance(outcome, Delivered) and self.keep(event_id):
                self.acks.append((event_id, time.time()))
            report(outcome)

        return timed


class _TimedSlots:
    """A batch's outcome slots that note when each delivery is stored."""

    def __init__(
        self,
        outcomes: OutcomeSlots,
        events: Sequence[ClaimedEvent],
        acks: list[tuple[str, float]],
        keep: Callable[[str], bool],
    ) -> None:
        self.outcomes, self.events, self.acks, self.keep = outcomes, events, acks, keep

    def __setitem__(self, index: int, outcome: Outcome, /) -> None:
        event_id = str(self.events[index].event_id)
        if self.keep(event_id):
            self.acks.append((event_id, time.time()))
        self.outcomes[index] = outcome


def drive(relay: Relay, counter: Synchronized[int], stop: Event) -> None:
    """Run ``relay`` in a thread, publishing its delivered count to ``counter``, until ``stop``."""
    thread = threading.Thread(target=relay.run, name="relay")
    thread.start()
    # The harness's own cost stays out of the relay's CPU: a thread join as the sleep (not a wait
    # on the multiprocessing Event: decision 0013), and the shared counter written only when it
    # changed.
    shown = -1
    while thread.is_alive() and not stop.is_set():
        delivered = relay.stats.delivered
        if delivered != shown:
            counter.value = shown = delivered
        thread.join(DRIVE_EVERY)
    relay.stop()
    thread.join()
    counter.value = relay.stats.delivered


def _relay(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    """The relay as ``outbox relay`` runs it: one outbox, or every schema of ``spec.schemas``
    (the tenants scenario: one relay serving the outboxes of a database)."""
    config = RelayConfig(spec.dsn, schema=spec.schema, **spec.relay_options)
    outboxes = [Outbox(s, spec.dsn, s) for s in spec.schemas] if spec.schemas else None
    sinks: list[AckTimingSink] = []

    def factory() -> KafkaSink | AckTimingSink:
        sink = KafkaSink(spec.bootstrap, delivery_timeout=config.delivery_timeout)
        if spec.ack_log is None:
            return sink
        sinks.append(AckTimingSink(sink, spec.ack_sample))
        return sinks[-1]

    drive(Relay(config, factory, outboxes), counter, stop)
    if spec.ack_log is not None:
        acks = [a for s in sinks for a in s.acks]
        Path(spec.ack_log).write_text(json.dumps(acks))


class _Flight:
    """A batch a minimal loop produced: its delivery reports outstanding, then its archive."""

    def __init__(self, conn: psycopg.Connection[Any] | None = None) -> None:
        self.conn = conn  # the session holding its rows' locks (the table loops)
        self.ids: list[int] = []
        # The WAL loop's columns: event ids, topics, keys, payloads, headers.
        self.cols: list[list[Any]] = [[] for _ in range(5)]
        self.pending = 0
        self.future: Future[None] | None = None

    def acked(self, _err: Any, _msg: Any) -> None:
        self.pending -= 1


class _Pipeline:
    """A minimal loop's batches out at once, at most FLIGHTS (the relay's default): each is
    archived on a finisher thread once its delivery reports are in, while the loop claims or
    reads and produces the next. That is the overlap the relay has (it finishes batches off
    its loop); a ceiling without it was a third slower than the relay. ``ordered``: one
    finisher, oldest batch first, as a WAL loop must commit (the relay too)."""

    def __init__(
        self,
        producer: Producer,
        finish: Callable[[_Flight], None],
        counter: Synchronized[int],
        *,
        ordered: bool,
    ) -> None:
        self.producer, self.finish, self.counter, self.ordered = producer, finish, counter, ordered
        self.flights: list[_Flight] = []
        self.pool = ThreadPoolExecutor(1 if ordered else FLIGHTS, thread_name_prefix="ceiling-finish")
        self.moved = 0

    @property
    def full(self) -> bool:
        return len(self.flights) >= FLIGHTS

    def produce(
        self,
        flight: _Flight,
        topics: list[str],
        payloads: list[bytes],
        keys: list[bytes | None],
        headers: list[Any],
    ) -> None:
        """Queue a batch as the relay's Kafka sink does (``produce_each``: one C-level loop, one
        call of ``flight.acked`` per report); a full client queue is served, then the rest."""
        flight.pending += len(topics)
        start = 0
        while True:
            start += produce_each(
                self.producer.produce,
                topics[start:],
                payloads[start:],
                keys[start:],
                repeat(flight.acked),
                headers[start:],
            )
            if start >= len(topics):
                return
            self.producer.poll(0.05)

    def add(self, flight: _Flight) -> None:
        self.flights.append(flight)
        self.producer.poll(0)  # what librdkafka queued goes out now

    def step(self, timeout: float) -> list[_Flight]:
        """Serve delivery reports (waiting ``timeout`` at most for one), hand each batch whose
        reports are all in to a finisher, and return those archived (committed)."""
        self.producer.poll(timeout)
        done: list[_Flight] = []
        for flight in list(self.flights):
            if flight.future is None:
                if flight.pending:
                    if self.ordered:
                        break
                    continue
                flight.future = self.pool.submit(self.finish, flight)
            elif flight.future.done():
                flight.future.result()
                self.flights.remove(flight)
                done.append(flight)
                self.moved += len(flight.ids)
                self.counter.value = self.moved
        return done

    def drain(self) -> None:
        """Wait until every batch produced is archived."""
        while self.flights:
            self.step(REPORT_WAIT)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _loop(
    spec: ContenderSpec, claim_name: str, archive_name: str, counter: Synchronized[int], stop: Event
) -> None:
    """The minimal loop: lock 2,000 rows with SKIP LOCKED, produce each with its headers and
    event-id; once their reports are in, delete + archive in one statement and commit, on a
    finisher thread, while the next batch is claimed on a second session. ``ceiling`` runs it
    on plain tables of its own; ``bare`` on the outbox's tables."""
    producer = Producer({"bootstrap.servers": spec.bootstrap, **PRODUCER_CONFIG})
    claim = query(claim_name, spec.schema)
    archive = query(archive_name, spec.schema)
    outbox_tables = archive_name == "archive_delivered"

    def finish(flight: _Flight) -> None:
        assert flight.conn is not None
        ids = flight.ids
        if outbox_tables:
            nulls = [None] * len(ids)
            flight.conn.execute(
                archive, {"ids": ids, "partitions": nulls, "offsets": nulls, "refs": nulls, "filtered": []}
            )
        else:
            flight.conn.execute(archive, {"ids": ids})
        flight.conn.commit()

    pipe = _Pipeline(producer, finish, counter, ordered=False)
    conns = [psycopg.connect(spec.dsn) for _ in range(FLIGHTS)]
    free = list(conns)
    try:
        while not stop.is_set():
            free += [f.conn for f in pipe.step(0 if free else REPORT_WAIT) if f.conn is not None]
            if not free:
                continue
            conn = free.pop()
            rows = conn.execute(claim, {"limit": BARE_BATCH}).fetchall()
            if not rows:
                conn.rollback()
                free.append(conn)
                if not pipe.flights:
                    time.sleep(IDLE_WAIT)
                continue
            flight = _Flight(conn)
            ids, event_ids, topics, keys, payloads, headers = map(list, zip(*rows, strict=True))
            flight.ids = ids
            pipe.produce(flight, topics, payloads, keys, list(map(_kafka_headers, event_ids, headers)))
            pipe.add(flight)
    finally:
        pipe.close()
        for conn in conns:
            conn.close()


def _steady_loop(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    """The minimal loop at steady load (``steady_loop``): see the module's docstring."""
    producer = Producer({"bootstrap.servers": spec.bootstrap, **PRODUCER_CONFIG})
    claim = query("bare_claim", spec.schema)
    archive = query("archive_delivered", spec.schema)
    acks: list[tuple[str, float]] = []
    coordinates: dict[int, tuple[int, int]] = {}  # the batch's index -> partition, offset

    def acked(index: int, event_id: str, err: Any, msg: Any) -> None:
        if err is None:
            acks.append((event_id, time.time()))
            coordinates[index] = (msg.partition(), msg.offset())

    moved = 0
    with psycopg.connect(spec.dsn, autocommit=True) as listen, psycopg.connect(spec.dsn) as conn:
        listen.execute(query("listen_events", "public", identifiers={"channel": channel_name(spec.schema)}))
        while not stop.is_set():
            rows = conn.execute(claim, {"limit": BARE_BATCH}).fetchall()
            if not rows:
                conn.rollback()
                # A NOTIFY sent while the claim ran waits on the connection: seen at once.
                for _ in listen.notifies(timeout=STEADY_IDLE_WAIT, stop_after=1):
                    pass
                continue
            coordinates.clear()
            for index, (_, event_id, topic, key, payload, headers) in enumerate(rows):
                producer.produce(
                    topic, payload, key, on_delivery=partial(acked, index, event_id),
                    headers=_kafka_headers(event_id, headers),
                )  # fmt: skip
            producer.flush()
            if len(coordinates) < len(rows):  # a send failed: its events stay for the next claim
                conn.rollback()
                continue
            ids = [row[0] for row in rows]
            partitions = [coordinates[i][0] for i in range(len(rows))]
            offsets = [coordinates[i][1] for i in range(len(rows))]
            conn.execute(
                archive,
                {"ids": ids, "partitions": partitions, "offsets": offsets, "refs": [], "filtered": []},
            )
            conn.commit()
            moved += len(rows)
            counter.value = moved
    if spec.ack_log is not None:
        Path(spec.ack_log).write_text(json.dumps(acks))


def _wal_loop(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    """The minimal WAL loop (``ceiling_wal``): see the module's docstring."""
    import psycopg2
    import psycopg2.extras

    producer = Producer({"bootstrap.servers": spec.bootstrap, **PRODUCER_CONFIG})
    with psycopg.connect(spec.dsn, autocommit=True) as db:
        state = capture.state(db, spec.schema)
    assert state.slot is not None and state.publication is not None
    prefix = capture.prefix_of(spec.schema).encode()
    archive = query("ceiling_wal_archive", spec.schema)
    stream = psycopg2.connect(spec.dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    cur = stream.cursor()
    cur.start_replication(
        slot_name=state.slot,
        decode=False,
        options={"proto_version": "1", "publication_names": state.publication, "messages": "true"},
    )
    ended = 0  # the end of the last transaction read whole: what the slot may be confirmed to
    read = 0  # events read so far (the plain archive's ids)
    conn = psycopg.connect(spec.dsn)

    def finish(flight: _Flight) -> None:  # one finisher: the batches' archives commit in order
        cols = flight.cols
        conn.execute(
            archive,
            {"ids": flight.ids, "event_ids": cols[0], "topics": cols[1], "keys": cols[2],
             "payloads": cols[3], "headers": cols[4]},
        )  # fmt: skip
        conn.commit()

    pipe = _Pipeline(producer, finish, counter, ordered=True)
    flight = _Flight()
    try:
        while not stop.is_set():
            msg = cur.read_message()
            if msg is None:
                if flight.ids:  # the stream paused: send and archive what was read
                    flight = _wal_send(pipe, flight, stop)
                pipe.drain()
                if ended:
                    cur.send_feedback(flush_lsn=ended)  # type: ignore[no-untyped-call]
                select.select([stream], [], [], IDLE_WAIT)
                continue
            data = msg.payload
            kind = data[:1]
            if kind == b"M":
                end = data.index(b"\0", 10)
                if data[10:end] != prefix:
                    continue
                # (The signature is not checked: a minimal loop trusts every role that can log in.)
                _created, head, headers, payload = data[end + 5 + wal_message.SIGNATURE_BYTES :].split(
                    b"\n", 3
                )
                event_id, topic, key, _type, _subject = json.loads(head)
                flight.ids.append(read)
                read += 1
                row = (
                    event_id,
                    topic,
                    None if key is None else bytes.fromhex(key),
                    payload,
                    headers.decode(),
                )
                for col, value in zip(flight.cols, row, strict=True):
                    col.append(value)
                if len(flight.ids) >= BARE_BATCH:  # as the table's ceiling: 2,000 a batch
                    flight = _wal_send(pipe, flight, stop)
            elif kind == b"C":
                (ended,) = struct.unpack_from(">Q", data, 10)
    finally:
        pipe.close()
        conn.close()
        stream.close()


def _wal_send(pipe: _Pipeline, flight: _Flight, stop: Event) -> _Flight:
    """The WAL loop's batch to Kafka, once fewer than FLIGHTS are out; the next batch's flight."""
    while pipe.full and not stop.is_set():
        pipe.step(REPORT_WAIT)
    event_ids, topics, keys, payloads, headers = flight.cols
    pipe.produce(flight, topics, payloads, keys, list(map(_kafka_headers, event_ids, headers)))
    pipe.add(flight)
    return _Flight()


def _kafka_headers(event_id: str, text: str | None) -> MessageHeaders:
    """An event's headers (JSON text, as the relay's claim sends them) and its event-id, as
    Kafka headers: what the relay sends, converted as the relay converts them."""
    out = decode_headers(text or None)
    out.append((EVENT_ID_HEADER, event_id.encode()))
    return out


def _seeds(spec: ContenderSpec, counter: Synchronized[int], stop: Event) -> None:
    producer = Producer({"bootstrap.servers": spec.bootstrap, **PRODUCER_CONFIG})
    claim = query("seeds_claim", spec.schema)
    lease = query("seeds_lease", spec.schema)
    delete = query("seeds_delete", spec.schema)
    moved = 0
    with psycopg.connect(spec.dsn) as conn:
        while not stop.is_set():
            row = conn.execute(claim).fetchone()
            if row is None:
                conn.rollback()
                time.sleep(IDLE_WAIT)
                continue
            id_, event_id, topic, key, payload, headers = row
            conn.execute(lease, (id_,))
            producer.produce(topic, value=payload, key=key, headers=_headers(event_id, headers))
            producer.flush()
            conn.execute(delete, (id_,))
            conn.commit()
            moved += 1
            counter.value = moved
