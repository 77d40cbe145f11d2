"""The doors an untrusted party writes an event through, and Hypothesis strategies that range each
field over its whole domain (issue 70).

- ``api``: ``outbox.enqueue`` / ``enqueue_many`` on psycopg 3, ``enqueue_async`` on asyncpg;
- ``sql``: a writer's own INSERT under the writer role's column grants (``±infinity``, 4713 BC
  and 294276 AD, empty and huge values, control characters, any JSON as headers);
- ``emit``: a writer's own ``emit_events`` with any bytes (encodings of events enqueue would
  refuse, heads with any JSON in each field, garbage);
- ``stranger``: ``pg_logical_emit_message`` under the outbox's prefix, by a role that may only log
  in (transactional or not);
- ``reply``: an event to the scripted webhook receiver, whose answers are any status, header and
  body, or a hang-up (:mod:`tests.fuzz.receiver`);
- ``transform``: an event whose payload tells the relay's transform what to raise or return.

Good events (a pool topic, a key of their own, plain headers) go in beside them through the api,
sql and emit doors: each must be delivered, once, byte for byte.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from hypothesis import strategies as st

from tests.fuzz.receiver import Reply

POOL = ("fz.a", "fz.b")  # topics routed to Kafka that Kafka takes: what is delivered is read back
HOOK = "hook.fz"  # routed to the scripted receiver
XF = "xf.fz"  # routed through the directed transform, then to Kafka
OUTBOXES = ("table", "wal")

# Text with what a terminal or a log reader acts on, and what PostgreSQL or an encoder refuses.
HOSTILE = (
    "\x1b]0;pwned\x07", "\x1b[2J\x1b[H", "\r\n2026-12-06 12:00:00,000 ERROR outbox.relay: forged",
    "\x00", "\u202e", "\x9b31m", "\ud800", "\n", "\t", "%s%d{schema}", "'; DROP TABLE x; --",
)  # fmt: skip
any_char = st.characters(exclude_categories=())  # every code point, lone surrogates and NUL too


def _text(max_size: int) -> st.SearchStrategy[str]:
    return st.text(alphabet=any_char, max_size=max_size)


wild_text = st.one_of(
    _text(24),
    st.builds(lambda a, b, c: a + b + c, _text(4), st.sampled_from(HOSTILE), _text(4)),
    st.text(min_size=240, max_size=260),
    st.just(""),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.floats() | st.integers(min_value=-(10**30), max_value=10**30) | wild_text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(wild_text, inner, max_size=3),
    max_leaves=8,
)
header_names = st.one_of(
    wild_text,
    st.sampled_from(["event-id", "Event-Key", "outbox-claim-check", "Nats-Rollup", "content-type", "x-note"]),
)
header_values = st.one_of(wild_text, st.binary(max_size=24))
wild_keys = st.one_of(
    st.none(),
    st.binary(max_size=24),
    wild_text,
    st.binary(min_size=2040, max_size=2060),  # about the limit a key index takes
).filter(lambda k: not _good_key(k))


def _good_key(key: object) -> bool:
    """Is ``key`` one of the good events' (``good-…``)? Wild keys keep out of their way: a dead
    letter parks its key, and a good event behind it would wait."""
    if isinstance(key, bytes):
        return key.startswith(b"good-")
    return isinstance(key, str) and key.startswith("good-")


wild_payloads = st.one_of(st.binary(max_size=120), wild_text, json_values)
# Times as PostgreSQL takes them in SQL: the ends of timestamptz's range and past Python's.
SQL_TIMES = (
    "-infinity", "infinity", "4713-01-01 00:00:00+00 BC", "0001-01-01 00:00:00+00 BC",
    "0001-01-01 00:00:00+00", "9999-12-31 23:59:59+00", "10000-01-01 00:00:00+00",
    "294276-12-31 23:00:00+00", "1970-01-01 00:00:00+00", "2000-01-01 00:00:00+00",
)  # fmt: skip
sql_times = st.one_of(st.none(), st.sampled_from(SQL_TIMES), st.just("now"), st.just("soon"))
api_times = st.one_of(
    st.none(),
    st.datetimes(
        timezones=st.sampled_from([timezone.utc, timezone(timedelta(hours=5)), timezone(timedelta(hours=-9))])
    ),
    st.sampled_from(
        [
            datetime.min.replace(tzinfo=timezone(timedelta(hours=5))),
            datetime.max.replace(tzinfo=timezone(timedelta(hours=-5))),
            datetime(2000, 1, 1),  # naive
        ]
    ),
)
api_delays = st.one_of(
    st.none(), st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.05, -1.0, 10**400])
)


@dataclass
class Input:
    """One write through one door, and what the fuzzer knows of it afterwards: the event ids it
    wrote (``ids``), or the error it was refused with (``refused``)."""

    door: str
    outbox: str
    fields: dict[str, Any]
    good: bool = False
    ids: list[str] = field(default_factory=list)
    refused: str | None = None  # the door's error (nothing written)
    contents: list[bytes] = field(default_factory=list)  # emit/stranger: each message's bytes
    candidates: list[str] = field(default_factory=list)  # emit: the ids its messages name

    def brief(self) -> str:
        shown = {
            k: (v if not isinstance(v, (bytes, str)) or len(v) < 60 else f"{v[:60]!r}…")
            for k, v in self.fields.items()
        }
        return f"{self.door}@{self.outbox}{' (good)' if self.good else ''}: {shown!r}"


# -- wild inputs ----------------------------------------------------------------------------------

api_events = st.fixed_dictionaries(
    {"topic": st.one_of(st.sampled_from(POOL), wild_text, st.just(HOOK)), "payload": wild_payloads},
    optional={
        "key": wild_keys,
        "headers": st.one_of(st.none(), st.dictionaries(header_names, header_values, max_size=3)),
        "delay": api_delays,
        "type": st.one_of(st.none(), wild_text),
        "subject": st.one_of(st.none(), wild_text),
        "expires_at": api_times,
    },
)


@st.composite
def api_inputs(draw: st.DrawFn) -> Input:
    door = draw(st.sampled_from(["api", "api_many", "api_async"]))
    many = door == "api_many"
    events = draw(st.lists(api_events, min_size=1, max_size=3)) if many else [draw(api_events)]
    return Input(door, draw(st.sampled_from(OUTBOXES)), {"events": events})


@st.composite
def sql_inputs(draw: st.DrawFn) -> Input:
    fields = {
        "event_id": str(uuid.UUID(int=draw(st.integers(0, 2**128 - 1)))),
        "topic": draw(st.one_of(st.sampled_from(POOL), wild_text)),
        "key": draw(st.one_of(wild_keys, st.just(b"a" * 5000))),  # one that compresses into the index
        "payload": draw(st.one_of(st.binary(max_size=120), st.just(b""))),
        "headers": json.dumps(
            draw(st.one_of(json_values, st.dictionaries(header_names, wild_text, max_size=3)))
        ),
        "type": draw(st.one_of(st.none(), wild_text)),
        "subject": draw(st.one_of(st.none(), wild_text)),
        "available_at": draw(sql_times),
        "expires_at": draw(sql_times),
    }
    return Input("sql", draw(st.sampled_from(OUTBOXES)), fields)


emit_heads = st.one_of(
    # An event's head whose every field is any JSON value
    st.lists(json_values, min_size=5, max_size=6).map(lambda h: json.dumps(h).encode()),
    # ... or a plausible one with one field gone wrong
    st.tuples(
        st.sampled_from([None, "not-a-uuid", 5]),
        st.one_of(st.sampled_from(POOL), wild_text),
        st.one_of(st.none(), st.binary(max_size=2100).map(bytes.hex), wild_text),
        st.one_of(st.none(), wild_text),
        st.one_of(st.none(), wild_text),
        st.one_of(
            st.none(),
            st.floats(),
            st.integers(min_value=-(10**20), max_value=10**20),
            st.just("1" + "0" * 400),
            wild_text,
        ),
    ).map(lambda t: t),
    st.binary(max_size=40),
)


@st.composite
def emit_inputs(draw: st.DrawFn) -> Input:
    messages = []
    for _ in range(draw(st.integers(1, 3))):
        head = draw(emit_heads)
        if isinstance(head, tuple):
            event_id = str(uuid.uuid4()) if head[0] is None else head[0]
            fields = [event_id, *head[1:5]]
            if head[5] is not None:
                fields.append(head[5])
            text = json.dumps(fields, allow_nan=True)
            if head[5] == "1" + "0" * 400:
                text = text.replace('"1' + "0" * 400 + '"', "1" + "0" * 400)
            head = text.encode("utf-8", "surrogatepass")
        headers = draw(
            st.one_of(st.just(b""), json_values.map(lambda v: json.dumps(v).encode()), st.binary(max_size=20))
        )
        payload = draw(st.one_of(st.binary(max_size=80), st.just(b"x" * 70_000)))
        messages.append(head + b"\n" + headers.replace(b"\n", b" ") + b"\n" + payload)
    return Input("emit", "wal", {"messages": messages})


@st.composite
def stranger_inputs(draw: st.DrawFn) -> Input:
    content = draw(st.one_of(st.binary(max_size=200), st.just(b"s" * 70_000)))
    return Input("stranger", "wal", {"content": content, "transactional": draw(st.booleans())})


replies = st.one_of(
    st.builds(
        Reply,
        status=st.one_of(st.sampled_from([200, 204, 400, 404, 408, 429, 500, 503]), st.integers(99, 999)),
        phrase=st.one_of(
            st.just(b"X"), st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
        ),
        headers=st.lists(
            st.tuples(
                st.sampled_from([b"retry-after", b"content-type", b"x-reply"]),
                st.one_of(
                    st.sampled_from(
                        [
                            b"\xc2\xb2",
                            b"-1",
                            b"1e9",
                            b"nan",
                            b"9" * 40,
                            b"Wed, 21 Oct 2015 07:28:00 GMT",
                            b"0",
                        ]
                    ),
                    st.binary(max_size=12).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"")),
                ),
            ),
            max_size=2,
        ).map(tuple),
        body=st.one_of(wild_text.map(lambda t: t.encode("utf-8", "surrogatepass")), st.binary(max_size=300)),
    ),
    st.just(Reply(hang_up=True)),
)


@st.composite
def reply_inputs(draw: st.DrawFn) -> Input:
    fields = {
        "payload": draw(st.binary(max_size=60)),
        "key": draw(st.one_of(st.none(), wild_keys)),
        "replies": draw(st.lists(replies, min_size=1, max_size=3)),
    }
    return Input("reply", draw(st.sampled_from(OUTBOXES)), fields)


directives = st.one_of(
    st.fixed_dictionaries({"raise": wild_text}),
    st.fixed_dictionaries(
        {
            "return": st.dictionaries(
                st.sampled_from(["topic", "key", "payload", "headers", "type", "subject", "event_id"]),
                json_values,
                max_size=3,
            )
        }
    ),
    st.just({"drop": True}),
)


@st.composite
def transform_inputs(draw: st.DrawFn) -> Input:
    return Input("transform", draw(st.sampled_from(OUTBOXES)), {"directive": draw(directives)})


wild_inputs = st.one_of(
    api_inputs(), sql_inputs(), emit_inputs(), stranger_inputs(), reply_inputs(), transform_inputs()
)


# -- good inputs ----------------------------------------------------------------------------------


@st.composite
def good_inputs(draw: st.DrawFn) -> Input:
    """A well-formed event: a pool topic, a key of the good ones' own (``good-``), plain headers and
    bytes: it must be delivered, once, as written."""
    outbox = draw(st.sampled_from(OUTBOXES))
    door = draw(st.sampled_from(["api", "sql", "emit"] if outbox == "wal" else ["api", "sql"]))
    fields = {
        "topic": draw(st.sampled_from(POOL)),
        "key": "good-" + draw(st.sampled_from("abc")),  # made unique to its round by the world
        "payload": draw(st.binary(min_size=1, max_size=64)),
        "headers": draw(
            st.dictionaries(st.sampled_from(["x-a", "x-b"]), st.text("abc ", max_size=8), max_size=2)
        ),
    }
    return Input(door, outbox, fields, good=True)


rounds = st.lists(st.one_of(wild_inputs, good_inputs()), min_size=2, max_size=7)
