"""NATS JetStream read back: each event at its stream and sequence (``get_msg``).

A sequence below the stream's first was removed by its limits or a purge: expired. One within
the stream that is not there was deleted; one past its last sequence, or a stream that no longer
exists, means the stream was deleted or made again: missing.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats
import nats.js.errors

from outbox.events import EVENT_ID_HEADER, KEY_HEADER
from outbox.sinks.routes import SinkURL
from outbox.verify.outcome import EXPIRED, MISSING, Archived, Held, Reader, Verdict, by_place, judge


class NatsReader(Reader):
    def __init__(self, url: SinkURL, *, timeout: float = 10.0, compare_bodies: bool = True) -> None:
        self.server = url.parts._replace(query="").geturl()
        self.timeout = timeout
        self.compare_bodies = compare_bodies

    def check(self, events: list[Archived]) -> list[Verdict]:
        verdicts = asyncio.run(self._check(events))
        return [verdicts[id(e)] for e in events]

    async def _check(self, events: list[Archived]) -> dict[int, Verdict]:
        verdicts, streams = by_place(
            events, lambda e: e.ref if e.ref and e.offset is not None else None, "stream and sequence"
        )
        if not streams:
            return verdicts
        nc = await nats.connect(servers=[self.server], connect_timeout=self.timeout, max_reconnect_attempts=0)
        try:
            js = nc.jetstream(timeout=self.timeout)
            for stream, group in streams.items():
                verdicts.update(await self._stream(js, stream, group))
        finally:
            await nc.close()
        return verdicts

    async def _stream(self, js: Any, stream: str, group: list[Archived]) -> dict[int, Verdict]:
        try:
            info = await js.stream_info(stream)
        except nats.js.errors.NotFoundError:
            return {id(e): Verdict(MISSING, "its stream no longer exists") for e in group}
        first, last = int(info.state.first_seq), int(info.state.last_seq)
        out: dict[int, Verdict] = {}
        for event in group:
            seq = event.offset
            assert seq is not None
            if seq > last:
                out[id(event)] = Verdict(MISSING, "past the last sequence: the stream was made again")
            elif seq < first:
                out[id(event)] = Verdict(EXPIRED, f"the stream now starts at sequence {first}")
            else:
                try:
                    msg = await js.get_msg(stream, seq)
                except nats.js.errors.NotFoundError:
                    out[id(event)] = Verdict(MISSING, "deleted from its stream")
                    continue
                out[id(event)] = judge(event, _held(msg), compare_bodies=self.compare_bodies)
        return out


def _held(msg: Any) -> Held:
    headers: dict[str, str] = dict(msg.headers or {})
    key = headers.get(KEY_HEADER)
    # The key travels as text (a key that is not UTF-8 is not sent as it is): compared when sent.
    return Held(headers.get(EVENT_ID_HEADER), None if key is None else key.encode(), msg.data or b"",
                key_returned=key is not None)  # fmt: skip
