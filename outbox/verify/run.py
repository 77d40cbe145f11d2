"""A verification: a window of the archive read back from the sinks, chunk by chunk, at a
bounded rate, each event judged; the summary by topic and sink, the missing by id."""

from __future__ import annotations

import datetime as dt
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox.errors import OutboxError
from outbox.sinks.routes import Route, SinkURL, route_for
from outbox.store.dsn import scrub
from outbox.store.queries import glob_regex, query
from outbox.verify.outcome import MISSING, UNVERIFIABLE, Archived, Reader, SinkUnreadable, Verdict

CHUNK = 5000  # archived events a statement reads, and a reader checks at once
SHOWN_IDS = 100  # missing event ids kept in a verification's row

EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)
ReaderFor = Callable[[SinkURL], Reader | None]  # None: the sink keeps nothing to read back


@dataclass(frozen=True)
class Lost:
    """An event its sink no longer holds."""

    delivered_id: int
    event_id: str
    topic: str
    sink: str
    reason: str


@dataclass
class Report:
    since: dt.datetime
    until: dt.datetime
    counts: Counter[str] = field(default_factory=Counter)
    by_place: dict[tuple[str, str], Counter[str]] = field(default_factory=dict)  # (topic, sink)
    missing: list[Lost] = field(default_factory=list)

    @property
    def checked(self) -> int:
        return sum(self.counts.values())

    def add(self, event: Archived, sink: str, verdict: Verdict) -> None:
        self.counts[verdict.outcome] += 1
        self.by_place.setdefault((event.topic, sink), Counter())[verdict.outcome] += 1
        if verdict.outcome == MISSING:
            self.missing.append(Lost(event.id, event.event_id, event.topic, sink, verdict.reason or ""))

    def as_json(self) -> dict[str, Any]:
        """The fixed shape of ``outbox verify --json``."""
        return {
            "checked": self.checked,
            "present": self.counts["present"],
            "missing": [lost.event_id for lost in self.missing],
            "expired": self.counts["expired"],
            "unverifiable": self.counts["unverifiable"],
        }


class Pace:
    """At most ``rate`` events read back a second (0: no bound), over the whole run."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:  # fmt: skip
        self.rate, self.clock, self.sleep = rate, clock, sleep
        self.started = clock()
        self.done = 0

    def took(self, n: int) -> None:
        self.done += n
        if self.rate > 0:
            ahead = self.done / self.rate - (self.clock() - self.started)
            if ahead > 0:
                self.sleep(ahead)


class Slices:
    """The window read a time slice at a time, in delivery order: a statement ordered over the
    whole rest of a day's million deliveries sorted it again for each chunk (PostgreSQL's CPU,
    not the sinks, set the pace). A slice that filled a chunk is read on from its last row, to
    a shorter end; one that held few makes the next one longer."""

    FIRST = dt.timedelta(minutes=1)
    SHORTEST = dt.timedelta(milliseconds=100)

    def __init__(self, since: dt.datetime, until: dt.datetime, chunk: int) -> None:
        self.lo, self.until, self.chunk = since, until, chunk
        self.step = self.FIRST
        self.after_at, self.after_id = EPOCH, -1  # where a full slice is read on from
        self._hi = since
        self._on = False  # the slice is read on: its bounds stay

    def next(self) -> tuple[dt.datetime, dt.datetime] | None:
        """The bounds of the next statement, or None when the window is read."""
        if self.lo >= self.until:
            return None
        if not self._on:
            self._hi = min(self.until, self.lo + self.step)
        return max(self.lo, self.after_at), self._hi  # read on: from where the last chunk ended

    def read(self, last_at: dt.datetime | None, last_id: int | None, n: int) -> None:
        """What the statement returned: its last row's time and id, and how many rows."""
        if n >= self.chunk and last_at is not None and last_id is not None:
            self.after_at, self.after_id = last_at, last_id  # the slice holds more
            self.step = max(self.SHORTEST, self.step / 2)
            self._hi = min(self._hi, last_at + self.step)  # the rest of it: the next slices'
            self._on = True
            return
        self._on = False
        self.lo, self.after_at, self.after_id = self._hi, EPOCH, -1
        if n < self.chunk // 4:
            self.step *= 2


def count(conn: psycopg.Connection[Any], schema: str, since: dt.datetime, until: dt.datetime,
          topics: str | None) -> int:  # fmt: skip
    """How many deliveries the window holds (what a run will check, for its progress)."""
    row = conn.execute(
        query("verify_count", schema),
        {"since": since, "until": until, "topics": None if topics is None else glob_regex(topics)},
    ).fetchone()
    return int(row[0]) if row else 0


def verify(
    conn: psycopg.Connection[Any],
    schema: str,
    routes: list[Route],
    reader_for: ReaderFor,
    *,
    since: dt.datetime,
    until: dt.datetime,
    topics: str | None = None,
    rate: float = 0.0,
    sample: int = 1,
    progress: Callable[[int], None] | None = None,
    chunk: int = CHUNK,
    stopping: Callable[[], bool] = lambda: False,
) -> Report:
    """Read back every delivery of ``since``..``until`` (of topics matching the glob ``topics``)
    from the sink its topic routes to (``sample``: one in that many, by id); ``reader_for`` makes
    each route's reader once. ``stopping``: asked before each chunk; a run told to stop returns
    what it found so far."""
    report = Report(since, until)
    readers: dict[str, Reader | None] = {}
    pace = Pace(rate)
    regex = None if topics is None else glob_regex(topics)
    slices = Slices(since, until, chunk)
    try:
        while not stopping() and (bounds := slices.next()) is not None:
            rows = conn.execute(
                query("verify_chunk", schema),
                {"since": bounds[0], "until": bounds[1], "topics": regex, "sample": sample,
                 "after_at": slices.after_at, "after_id": slices.after_id, "limit": chunk},
            ).fetchall()  # fmt: skip
            conn.commit()  # no snapshot held while the sinks are read
            slices.read(rows[-1][8] if rows else None, int(rows[-1][0]) if rows else None, len(rows))
            if not rows:
                continue
            events = [Archived.from_row(row) for row in rows]
            by_sink: dict[str, list[Archived]] = {}
            urls: dict[str, SinkURL] = {}
            for event in events:
                route = route_for(routes, event.topic)
                if route is None:
                    report.add(event, "(no route)", Verdict(UNVERIFIABLE, "no route takes its topic now"))
                    continue
                urls[route.url.display] = route.url
                by_sink.setdefault(route.url.display, []).append(event)
            for sink, group in by_sink.items():
                verdicts = _checked(readers, reader_for, urls[sink], group)
                for event, verdict in zip(group, verdicts, strict=True):
                    report.add(event, sink, verdict)
                pace.took(len(group))
            if progress is not None:
                progress(report.checked)
        return report
    finally:
        for reader in readers.values():
            if reader is not None:
                reader.close()


def _checked(
    readers: dict[str, Reader | None], reader_for: ReaderFor, url: SinkURL, events: list[Archived]
) -> list[Verdict]:
    """``events`` read back from ``url``'s sink (its reader made once, kept in ``readers``)."""
    try:
        if url.display not in readers:
            readers[url.display] = reader_for(url)
        reader = readers[url.display]
        if reader is None:
            return [Verdict(UNVERIFIABLE, "the sink keeps no log to read back")] * len(events)
        return reader.check(events)
    except OutboxError:
        raise
    except Exception as exc:  # the client's own errors, whatever their type: one line, no verdict
        said = scrub(str(exc) or type(exc).__name__, url.hidden)
        raise SinkUnreadable(f"{url.display} cannot be read back: {said}") from None


def record(conn: psycopg.Connection[Any], schema: str, report: Report, via: str) -> None:
    """The summary as the outbox's latest verification (the console and status show it)."""
    ids = [lost.event_id for lost in report.missing[:SHOWN_IDS]]
    conn.execute(
        query("verification_record", schema),
        {"via": via, "since": report.since, "until": report.until, "checked": report.checked,
         "present": report.counts["present"], "missing": report.counts["missing"],
         "expired": report.counts["expired"], "unverifiable": report.counts["unverifiable"],
         "missing_ids": "{" + ",".join(ids) + "}"},
    )  # fmt: skip
    conn.commit()
