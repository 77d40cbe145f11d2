"""The relay's own verification, on a schedule (``outbox relay --verify-every``): every period,
each outbox it serves has a sample of its last window of deliveries read back, on a thread and
connections of its own at a bounded rate, so that delivery does not wait on it. The results go
to the metrics and the outbox's verifications; a line when a sink is first found to have lost
events, and one when none is missing again."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.errors import OutboxError
from outbox.observe.prometheus import Counter, Gauge
from outbox.sinks.routes import Route
from outbox.store import pinning
from outbox.store.outboxes import Outbox
from outbox.verify import run

log = logging.getLogger("outbox.verify")


@dataclass(frozen=True)
class Schedule:
    every: float  # seconds between runs
    window: float = 3600.0  # seconds of deliveries a run looks back over
    sample: int = 100  # one delivery in this many (by id) is read back; 1: all
    rate: float = 1000.0  # deliveries read back a second, at most
    settle: float = 5.0  # the last seconds left to the next run (batches being archived)


@dataclass(frozen=True)
class VerifyMetrics:
    missing: Gauge  # outbox_sink_missing_events{outbox,topic,sink}: the latest run's
    checked: Counter  # outbox_verify_checked_total{outbox}


class Verifier:
    """Runs :func:`outbox.verify.run.verify` for each served outbox every ``schedule.every``."""

    def __init__(
        self,
        outboxes: Callable[[], list[Outbox]],
        routes: list[Route],
        reader_for: run.ReaderFor,
        metrics: VerifyMetrics,
        schedule: Schedule,
        connect: Callable[[str], psycopg.Connection[Any]] = lambda dsn: psycopg.connect(dsn),
    ) -> None:
        self.outboxes, self.routes, self.reader_for = outboxes, routes, reader_for
        self.metrics, self.schedule, self.connect = metrics, schedule, connect
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="outbox-verify", daemon=True)
        self._losing: dict[str, int] = {}  # outbox -> missing at its last run (said once)
        self._failing: dict[str, str] = {}  # outbox -> why its last run failed (said once)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)

    def _loop(self) -> None:
        while not self._stop.wait(self.schedule.every):
            for outbox in self.outboxes():
                if self._stop.is_set():
                    return
                self.run_once(outbox)

    def run_once(self, outbox: Outbox, now: dt.datetime | None = None) -> run.Report | None:
        """One outbox's verification; None when it could not run (said once, in one line)."""
        now = now or dt.datetime.now(dt.timezone.utc)
        s = self.schedule
        until = now - dt.timedelta(seconds=s.settle)
        since = until - dt.timedelta(seconds=s.window)
        try:
            with self.connect(outbox.dsn) as conn:
                pinning.pin(conn)
                report = run.verify(
                    conn, outbox.schema, self.routes, self.reader_for, since=since, until=until,
                    rate=s.rate, sample=s.sample, stopping=self._stop.is_set,
                )  # fmt: skip
                if self._stop.is_set():
                    return None  # cut short by the relay's shutdown: not a verification
                run.record(conn, outbox.schema, report, "relay")
        except (OutboxError, psycopg.Error) as exc:
            why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            if self._failing.get(outbox.name) != why:
                log.warning(
                    "%s: verification could not run: %s", outbox.name, why, extra={"outbox": outbox.name}
                )
                self._failing[outbox.name] = why
            return None
        self._failing.pop(outbox.name, None)
        self._note(outbox.name, report)
        return report

    def _note(self, name: str, report: run.Report) -> None:
        self.metrics.checked.inc((name,), report.checked)
        missing: dict[tuple[str, ...], float] = {}
        for lost in report.missing:
            missing[(name, lost.topic, lost.sink)] = missing.get((name, lost.topic, lost.sink), 0) + 1
        # Every place read this run, 0 where nothing is missing: the alert sees a loss end.
        for topic, sink in report.by_place:
            missing.setdefault((name, topic, sink), 0)
        self.metrics.missing.replace_where(0, name, missing)
        before, now_missing = self._losing.get(name, 0), len(report.missing)
        if now_missing and not before:
            first = report.missing[0]
            log.error(
                "%s: a sink lost delivered events: %d of %d read back are missing (the first: %s on %s, %s); "
                "outbox verify --repair sends them again",
                name, now_missing, report.checked, first.event_id, first.sink, first.reason,
                extra={"event": "verify.missing", "outbox": name},
            )  # fmt: skip
        elif before and not now_missing:
            log.info("%s: nothing read back is missing any more", name, extra={"outbox": name})
        self._losing[name] = now_missing
