"""The fuzzer's invariants, judged from what a round recorded and what the tables, the receiver
and the relay's log hold. It shares nothing with the relay but the names of its tables.

- the relay never exits, and settles every round (nothing stalls, nothing loops);
- an input refused at a door is refused with an error that names the field (the API), or by
  PostgreSQL itself (a writer's own SQL);
- every good event is delivered, once, as written;
- every other event is delivered, or dead-lettered with a reason that names its field (or says
  what refused it: its expiry, a transform, a receiver's status), or waits where it should (a
  later availability, a parked key);
- every WAL message is accounted for: an event, or a dead letter that keeps its bytes;
- nothing a stranger wrote reaches a log line, a stored reason or a command's output unescaped,
  and every log line is one the relay started.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from psycopg import sql

from tests.fuzz.doors import HOOK, XF, Input
from tests.fuzz.world import FINAL, Round, World

KEPT = 64 * 1024  # what a dead letter keeps of a message that is no event (the relay's promise)
# The fields an event has, as a reason may name them; and the kinds whose reason says what refused it.
FIELD_WORDS = (
    "topic", "key", "payload", "header", "type", "subject", "expires_at", "available_at", "created_at",
    "event_id", "id:", "head", "message", "attribute",
)  # fmt: skip
# (A receiver that hangs up or does not answer: unavailable, timeout; its status: http_<status>.)
SAID_KINDS = ("expired", "transform_failed", "unsigned_event", "unavailable", "timeout")
API_FIELDS = re.compile(r"^(TypeError|ValueError|InvalidEvent|InvalidEventType): "
                        r"(events(\[\d+\])?(\.|: )|topic|payload|key|headers|delay|type|subject|expires_at)")  # fmt: skip
LINE_START = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: |  ")
_UNSAFE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]|[\ud800-\udfff]")


Bad = Callable[[str, str], None]  # (invariant, detail): one violation found


@dataclass
class Violation:
    round: int
    invariant: str
    detail: str

    def __str__(self) -> str:
        return f"round {self.round}: {self.invariant}: {self.detail}"


def unsafe(text: str) -> bool:
    """Does ``text`` hold a character a terminal or a log reader acts on (a line break aside)?"""
    return bool(_UNSAFE.search(text.replace("\n", "")))


def names_a_field(kind: str, reason: str) -> bool:
    low = reason.lower()
    return kind in SAID_KINDS or kind.startswith("http_") or any(word in low for word in FIELD_WORDS)


def check_round(world: World, r: Round) -> list[Violation]:
    out: list[Violation] = []

    def bad(invariant: str, detail: str) -> None:
        out.append(Violation(r.number, invariant, detail))

    if world.relay.poll() is not None:
        bad("relay alive", f"the relay exited with {world.relay.returncode}")
    if not r.settled:
        stuck = {k: v for k, v in world.states(r).items() if v not in FINAL}
        bad("settles", f"not settled in time: {stuck}")
    states = world.states(r, candidates=True)
    rows = _rows(world, r)
    for inp in r.inputs:
        if inp.refused is not None:
            if inp.door.startswith("api") and not API_FIELDS.match(inp.refused):
                bad("refused naming the field", f"{inp.brief()} -> {inp.refused[:300]!r}")
            if inp.good:
                bad("good events delivered", f"{inp.brief()} was refused: {inp.refused[:300]!r}")
            continue
        for event_id in inp.ids or [c for c in inp.candidates if inp.door != "emit"]:
            state = states.get((inp.outbox, event_id), "unseen")
            if state == "unseen" and event_id in inp.candidates:
                continue  # a message that is no event: accounted for below
            row = rows.get((inp.outbox, event_id))
            if inp.good and state != "delivered":
                bad("good events delivered", f"{inp.brief()}: {event_id} is {state} {row}")
                continue
            if state == "dead" and row is not None and not names_a_field(row[0], row[1]):
                bad("dead letters name the field", f"{inp.brief()}: {row}")
            if state == "delivered" and row is not None and inp.good:
                _same(bad, inp, row)
            if inp.door == "reply":
                _replied(bad, world, inp, event_id, state)
        if inp.outbox == "wal" and inp.door in ("emit", "reply", "transform"):
            _accounted(bad, inp, states, rows, r, world)
        if inp.door == "stranger":
            _stranger(bad, inp, r, world)
    for (outbox, event_id), state in states.items():
        if event_id in r.markers.values() and state != "delivered":
            bad("good events delivered", f"the marker {event_id} of {outbox} is {state}")
    for kind, reason in _reasons(world, r):
        if unsafe(reason):
            bad("reasons escaped", f"{kind}: {reason[:200]!r}")
    log = world.new_log()
    for line in filter(None, log.split("\n")):
        if not LINE_START.match(line):
            bad("log lines are the relay's", f"{line[:200]!r}")
        elif unsafe(line):
            bad("log lines escaped", f"{line[:200]!r}")
    if "Traceback" in log:
        bad("expected errors are one line", log[log.index("Traceback") - 300 : log.index("Traceback") + 1500])
    return out


def _rows(world: World, r: Round) -> dict[tuple[str, str], tuple[str, str, str, bytes | None, bytes]]:
    """(outbox, event id) -> (kind or 'delivered', reason, topic, key, payload) of the round's
    delivered events and dead letters."""
    out = {}
    with psycopg.connect(world.dsn) as conn:
        for name, ids in world.ids_of(r, candidates=True).items():
            s = sql.Identifier(world.schemas[name])
            for event_id, kind, reason, topic, key, payload in conn.execute(
                sql.SQL(
                    "SELECT event_id::text, 'delivered', coalesce(filtered_by, ''), topic, key, payload "
                    "FROM {s}.delivered WHERE event_id = ANY(%(ids)s::uuid[]) UNION ALL "
                    "SELECT event_id::text, kind, error, topic, key, payload FROM {s}.dead_letters "
                    "WHERE event_id = ANY(%(ids)s::uuid[])"
                ).format(s=s),
                {"ids": ids},
            ):
                out[(name, event_id)] = (
                    kind,
                    reason,
                    topic,
                    None if key is None else bytes(key),
                    bytes(payload),
                )
    return out


def _reasons(world: World, r: Round) -> list[tuple[str, str]]:
    """Every reason stored since the round began: dead letters' and retries' last errors."""
    out: list[tuple[str, str]] = []
    with psycopg.connect(world.dsn) as conn:
        for name, schema in world.schemas.items():
            s = sql.Identifier(schema)
            out += conn.execute(
                sql.SQL("SELECT kind, error FROM {}.dead_letters WHERE seq > %s").format(s),
                (r.dead_seq[name],),
            ).fetchall()
            out += conn.execute(
                sql.SQL(
                    "SELECT coalesce(last_error_kind, ''), last_error FROM {}.events WHERE last_error IS NOT NULL"
                ).format(s)
            ).fetchall()
    return out


def _same(bad: Bad, inp: Input, row: tuple[str, str, str, bytes | None, bytes]) -> None:
    _, _, topic, key, payload = row
    want_key = inp.fields["key"].encode() if isinstance(inp.fields["key"], str) else inp.fields["key"]
    if (topic, key, payload) != (inp.fields["topic"], want_key, inp.fields["payload"]):
        bad("delivered as written", f"{inp.brief()}: archived {(topic, key, payload)!r}")


def _replied(bad: Bad, world: World, inp: Input, event_id: str, state: str) -> None:
    """An event to the scripted receiver: delivered only if the receiver answered a 2xx (once, if
    every 2xx was well-formed), with the payload as written; dead only if no well-formed 2xx."""
    with world.receiver.lock:
        accepted = [a for a in world.receiver.accepted if a.event_id == event_id]
    clean = [a for a in accepted if a.clean]
    if state == "delivered" and (not accepted or len(clean) > 1):
        bad(
            "delivered once",
            f"{inp.brief()}: delivered; the receiver answered {len(accepted)} 2xx, {len(clean)} clean",
        )
    if state == "delivered" and any(a.request.body != inp.fields["payload"] for a in accepted):
        bad("delivered as written", f"{inp.brief()}: the receiver got {[a.request.body for a in accepted]!r}")
    if state == "dead" and clean:
        bad("delivered once", f"{inp.brief()}: dead-lettered, yet the receiver accepted it with a clean 2xx")


def _accounted(bad: Bad, inp: Input, states: dict, rows: dict, r: Round, world: World) -> None:
    """Each message a writer emitted is an event of its id, or a dead letter that keeps its bytes."""
    kept = _kept(world, r, "wal")
    for content in inp.contents:
        named = [c for c in inp.candidates if states.get(("wal", c), "unseen") != "unseen"]
        if any(c.encode() in content for c in named):
            continue
        if not any(content[: KEPT - 64] in payload for payload in kept):
            bad("every WAL message accounted for", f"{content[:120]!r}: neither an event nor a dead letter")


def _stranger(bad: Bad, inp: Input, r: Round, world: World) -> None:
    content = inp.contents[0]
    kept = [p for p in _kept(world, r, "wal", unsigned=True)]
    found = content[:KEPT] in kept
    if inp.fields["transactional"] and not found:
        bad(
            "every WAL message accounted for",
            f"a stranger's {content[:80]!r}: no unsigned dead letter keeps it",
        )


def _kept(world: World, r: Round, outbox: str, *, unsigned: bool = False) -> list[bytes]:
    """The payloads of the dead letters the round made in ``outbox`` (only unsigned_event's)."""
    with psycopg.connect(world.dsn) as conn:
        rows = conn.execute(
            sql.SQL(
                "SELECT payload FROM {}.dead_letters WHERE seq > %s AND (NOT %s OR kind = 'unsigned_event')"
            ).format(sql.Identifier(world.schemas[outbox])),
            (r.dead_seq[outbox], unsigned),
        ).fetchall()
    return [bytes(p) for (p,) in rows]


def check_end(world: World, delivered_to_kafka: Counter[str], good: dict[str, Input]) -> list[str]:
    """After every round: each good event on Kafka once, and the commands' output escaped."""
    out = []
    for event_id, inp in good.items():
        n = delivered_to_kafka.get(event_id, 0)
        if n != 1:
            out.append(f"good event {event_id} ({inp.brief()}) is on Kafka {n} times")
    return out


__all__ = ["HOOK", "XF", "Violation", "check_end", "check_round", "unsafe"]
