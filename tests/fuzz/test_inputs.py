"""The input fuzzer (issue 70): Hypothesis writes rounds of events whose every field ranges over its
whole domain, through every door an untrusted party has (:mod:`tests.fuzz.doors`), beside good
events, to the real relay serving a table outbox and a WAL outbox (:mod:`tests.fuzz.world`); the
checker (:mod:`tests.fuzz.checker`) judges each round. The counterpart of the schedule explorer:
that one searches schedules, this one inputs.

CI plays a fixed budget (``OUTBOX_TEST_FUZZ_EXAMPLES`` rounds, 30 by default, the same ones every run:
derandomized) after every regression case below. A longer search, random and remembering what
failed (Hypothesis's database, .hypothesis/):

    OUTBOX_TEST_FUZZ_EXAMPLES=2000 OUTBOX_TEST_FUZZ_RANDOM=1 .venv/bin/python -m pytest tests/fuzz -p no:xdist

Every round that ever failed stays below as an ``@example``, with what it found.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from hypothesis import HealthCheck, example, given, settings

from tests.fuzz.checker import check_end, check_round, unsafe
from tests.fuzz.doors import HOOK, POOL, Input, rounds
from tests.fuzz.receiver import Reply
from tests.fuzz.world import World

EXAMPLES = int(os.environ.get("OUTBOX_TEST_FUZZ_EXAMPLES", "30"))
RANDOM = os.environ.get("OUTBOX_TEST_FUZZ_RANDOM") == "1"


def _good(door: str, outbox: str, n: int) -> Input:
    return Input(
        door,
        outbox,
        {"topic": POOL[n % 2], "key": "good-a", "payload": b"good %d" % n, "headers": {}},
        good=True,
    )


def _sql(outbox: str = "table", **fields: object) -> Input:
    base: dict[str, object] = {
        "event_id": "6f0c3b9e-58a4-4b8e-9d53-2b1f9ad0b6a1", "topic": POOL[0], "key": None, "payload": b"x",
        "headers": "{}", "type": None, "subject": None, "available_at": None, "expires_at": None,
    }  # fmt: skip
    return Input("sql", outbox, base | fields)


def _emit(head: str) -> Input:
    return Input("emit", "wal", {"messages": [head.encode() + b"\n\npayload"]})


# Each finding of issue 70 (the list it was filed with), and each round the fuzzer found failing since.
REGRESSIONS: list[tuple[str, list[Input]]] = [
    ("1: an expiry of -infinity ended every relay serving the outbox, and 4713 BC too",
     [_sql(expires_at="-infinity"), _sql("wal", event_id="0d9b7f52-1c55-4bb0-8a22-3bb4b1b2c0aa",
                                         expires_at="4713-01-01 00:00:00+00 BC"), _good("api", "wal", 1)]),
    ("1: enqueue took an expiry of 0001-12-31 BC (datetime.min at +05:00)",
     [Input("api", "table", {"events": [{"topic": POOL[0], "payload": b"x",
                                         "expires_at": datetime.min.replace(tzinfo=timezone(timedelta(hours=5)))}]}),
      _good("api", "table", 2)]),
    ("1, 2: emit_events with expiries -1e300, 1e300 and a 1 with 400 zeros; a key too long for its index",
     [_emit('["2b1f9ad0-b6a1-4b8e-9d53-6f0c3b9e58a4","fz.a",null,null,null,-1e300]'),
      _emit('["3b1f9ad0-b6a1-4b8e-9d53-6f0c3b9e58a4","fz.a",null,null,null,1e300]'),
      _emit('["4b1f9ad0-b6a1-4b8e-9d53-6f0c3b9e58a4","fz.a",null,null,null,1' + "0" * 400 + "]"),
      _emit('["5b1f9ad0-b6a1-4b8e-9d53-6f0c3b9e58a4","fz.a","' + "ab" * 1500 + '",null,null]'),
      _good("emit", "wal", 3)]),
    ("2: enqueue took a 3,000-byte key the key indexes refuse (the WAL batch was read again without end)",
     [Input("api", "wal", {"events": [{"topic": POOL[0], "payload": b"x", "key": b"k" * 3000}]}),
      _good("api", "wal", 4)]),
    ("2: a stranger's large messages kept whole", [
        Input("stranger", "wal", {"content": b"s" * 70_000, "transactional": True}),
        Input("stranger", "wal", {"content": b"t" * 10, "transactional": False}),
        _good("api", "wal", 5)]),
    ("5: a receiver's 400 body with a NUL, a CR/LF and a forged line; Retry-After: \u00b2", [
        Input("reply", "table", {"payload": b"p", "key": "r", "replies": [
            Reply(503, b"X", ((b"retry-after", b"\xc2\xb2"),), b"busy"),
            Reply(400, b"Bad\x1b[2J", (), b"no\x00\r\n2026-12-06 12:00:00,000 ERROR outbox.relay: forged\x1b]0;t\x07")]}),
        _good("api", "table", 6)]),
    ("the fuzzer: a delay of 9.2e12 s, accepted by enqueue, refused by PostgreSQL naming no field",
     [Input("api", "table", {"events": [{"topic": POOL[0], "payload": b"", "delay": 9222521454154.0}]}),
      _good("api", "table", 8)]),
    ("the fuzzer: a delay of 10**400 raised OverflowError, naming no field",
     [Input("api", "table", {"events": [{"topic": POOL[0], "payload": b"", "delay": 10**400}]}), _good("api", "table", 9)]),
    ("the checker's: a 200 with a NUL in a header is no answer the relay can read (retried, then dead)",
     [Input("reply", "table", {"payload": b"", "key": None, "replies": [Reply(200, b"X", ((b"x-reply", b"\x00"),))]}),
      _good("api", "table", 10)]),
    ("the checker's: a 200 with a NUL in its reason phrase is a 200 to aiohttp",
     [Input("reply", "table", {"payload": b"", "key": None, "replies": [Reply(200, b"\x00", (), b"0" * 40)]}),
      _good("api", "table", 11)]),
    ("the checker's: a 204 with a body is no response aiohttp reads (the body is the next status line)",
     [Input("reply", "table", {"payload": b"", "key": None, "replies": [Reply(204, b"X", (), b"0")]}),
      _good("api", "table", 12)]),
    ("the world's: a WAL event with a key over the limit is a dead letter of its own id (it waited for the first)",
     [Input("reply", "wal", {"payload": b"p", "key": b"\xf8" * 2050, "replies": [Reply(200)]}),
      Input("transform", "table", {"directive": {"drop": True}})]),
    ("5: a transform's exception message with escape sequences", [
        Input("transform", "wal", {"directive": {"raise": "boom\r\n\x1b[2Jforged"}}),
        Input("transform", "table", {"directive": {"return": {"headers": {"event-id": "forged", "a\r\nb": "c"}}}}),
        _good("api", "table", 7)]),
]  # fmt: skip


@pytest.fixture(scope="module")
def world(pg_dsn: str, kafka: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    with psycopg.connect(pg_dsn) as conn:
        level, version = conn.execute(
            "SELECT current_setting('wal_level'), current_setting('server_version_num')::int"
        ).fetchone()  # type: ignore[misc]
    w = World(pg_dsn, kafka, tmp_path_factory.mktemp("fuzz"), wal=level == "logical" and version >= 140000)
    try:
        yield w
    finally:
        w.close()


def _with_regressions(test):  # type: ignore[no-untyped-def]
    for _, inputs in reversed(REGRESSIONS):
        test = example(inputs)(test)
    return test


# A failing round's inputs may be large (70 KB messages): Hypothesis says so, and it is no error here.
@pytest.mark.filterwarnings("ignore:Generating overly large repr")
@pytest.mark.timeout(max(300, EXAMPLES * 3))  # a long search (and its shrinking) outlasts the suite's 300 s
def test_no_input_ends_stalls_or_loops_the_relay_and_each_bad_one_is_its_own_dead_letter(
    world: World, kafka: str, pg_dsn: str
) -> None:
    good: dict[str, Input] = {}
    played: Counter[str] = Counter()

    # CI: the same rounds every run, nothing remembered; a random search remembers what failed.
    kept = {} if RANDOM else {"database": None}

    @settings(
        max_examples=EXAMPLES, deadline=None, derandomize=not RANDOM, suppress_health_check=list(HealthCheck),
        print_blob=True, **kept,
    )  # fmt: skip
    @_with_regressions
    @given(rounds)
    def one_round(inputs: list[Input]) -> None:
        inputs = copy.deepcopy(inputs)
        r = world.play(inputs)
        for inp in inputs:
            played[inp.door] += 1
            if inp.good:
                good.update(dict.fromkeys(inp.ids, inp))
        violations = check_round(world, r)
        assert not violations, (
            "\n".join(map(str, violations)) + "\n\nthe round:\n" + "\n".join(i.brief() for i in inputs)
        )

    one_round()
    on_kafka = _read_kafka(kafka)
    assert not (late := check_end(world, on_kafka, good)), late
    outputs = _commands(world, pg_dsn)
    assert not [o for o in outputs if unsafe(o)], [o[:500] for o in outputs if unsafe(o)]
    assert world.stop() == 0, world.new_log()[-3000:]
    summary = {"rounds": len(world.rounds), "inputs": sum(played.values()), "by_door": dict(played)}
    print(f"fuzzer: {json.dumps(summary)}")  # the closing notes' figures (pytest -s)
    if report := os.environ.get("OUTBOX_TEST_FUZZ_REPORT"):
        Path(report).write_text(json.dumps(summary))


def _read_kafka(bootstrap: str) -> Counter[str]:
    """How many times each event id is on the pool's topics."""
    consumer = Consumer(
        {"bootstrap.servers": bootstrap, "group.id": f"fuzz-{time.time()}", "enable.auto.commit": False}
    )
    seen: Counter[str] = Counter()
    try:
        parts = []
        for topic in POOL:
            meta = consumer.list_topics(topic, timeout=10).topics[topic]
            parts += [TopicPartition(topic, p, 0) for p in meta.partitions]
        ends = {(tp.topic, tp.partition): consumer.get_watermark_offsets(tp, timeout=10)[1] for tp in parts}
        consumer.assign(parts)
        left = {k for k, end in ends.items() if end > 0}
        deadline = time.monotonic() + 60
        while left and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None or msg.error():
                continue
            event_id = dict(msg.headers() or []).get("event-id")
            if event_id is not None:
                seen[event_id.decode()] += 1
            if msg.offset() + 1 >= ends[(msg.topic(), msg.partition())]:
                left.discard((msg.topic(), msg.partition()))
    finally:
        consumer.close()
    return seen


def _commands(world: World, dsn: str) -> list[str]:
    """What the commands that show events print after the run: none of it may be unescaped."""
    out = []
    for schema in world.schemas.values():
        for args in (["status"], ["dead", "list"], ["status", "--json"], ["dead", "list", "--json"]):
            done = subprocess.run(
                [sys.executable, "-m", "outbox", *args, "--dsn", dsn, "--schema", schema],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            out.append(done.stdout + done.stderr)
    return out


__all__ = ["HOOK"]
