"""Redis Streams read back: each event at its stream (the topic) and entry id, a pipeline of
``XRANGE id id`` a batch.

An entry id below the stream's first entry was trimmed (``XTRIM``, ``MAXLEN``): expired. One
within the stream that is not there was deleted (``XDEL``), and one past the last id the stream
generated means the stream was deleted and made again (a restart without persistence): missing.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.exceptions

from outbox.events import EVENT_ID_HEADER
from outbox.sinks.routes import SinkURL
from outbox.verify.outcome import EXPIRED, MISSING, Archived, Held, Reader, Verdict, by_place, judge

StreamId = tuple[int, int]


def stream_id(text: str | bytes | None) -> StreamId | None:
    """``ms-seq`` as a pair that orders as Redis orders entry ids (None: not one)."""
    if isinstance(text, bytes):
        text = text.decode("ascii", "replace")
    if not text:
        return None
    ms, _, seq = text.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return None


class RedisReader(Reader):
    def __init__(self, url: SinkURL, *, timeout: float = 10.0, compare_bodies: bool = True) -> None:
        self.compare_bodies = compare_bodies
        self.client: Any = redis.Redis.from_url(
            url.parts._replace(query="").geturl(), socket_timeout=timeout, socket_connect_timeout=timeout
        )

    def check(self, events: list[Archived]) -> list[Verdict]:
        verdicts, streams = by_place(
            events, lambda e: None if stream_id(e.ref) is None else e.topic, "entry id"
        )
        for stream, group in streams.items():
            verdicts.update(self._stream(stream, group))
        return [verdicts[id(e)] for e in events]

    def _stream(self, stream: str, group: list[Archived]) -> dict[int, Verdict]:
        try:
            info = self.client.xinfo_stream(stream)
        except redis.exceptions.ResponseError:  # no such key
            return {id(e): Verdict(MISSING, "its stream no longer exists") for e in group}
        first_entry = info.get("first-entry")
        first = stream_id(first_entry[0]) if first_entry else None
        last = stream_id(info.get("last-generated-id"))
        out: dict[int, Verdict] = {}
        read: list[Archived] = []
        for event in group:
            entry = stream_id(event.ref)
            assert entry is not None
            if last is not None and entry > last:
                out[id(event)] = Verdict(MISSING, "past the last entry id: the stream was made again")
            elif first is None or entry < first:
                out[id(event)] = Verdict(EXPIRED, "the stream was trimmed past it")
            else:
                read.append(event)
        pipe = self.client.pipeline(transaction=False)
        for event in read:
            pipe.xrange(stream, event.ref, event.ref, count=1)
        for event, reply in zip(read, pipe.execute(), strict=True):
            held = _held(reply[0][1]) if reply else None
            out[id(event)] = judge(event, held, compare_bodies=self.compare_bodies)
        return out

    def close(self) -> None:
        self.client.close()


def _held(fields: dict[bytes, bytes]) -> Held:
    raw = fields.get(EVENT_ID_HEADER.encode())
    event_id = raw.decode("utf-8", "replace") if raw is not None else None
    # The sink's fields (outbox.sinks.redis.fields): the key absent when null.
    return Held(event_id, fields.get(b"key"), fields.get(b"payload", b""), key_returned=True)
