"""The scripted sink: a receiver that answers as the schedule says, and a journal of what it got.

Loaded into each relay process with ``outbox relay --sink outbox_bench.explore.sink:scripted``;
it reads the schedule and where to write from the environment (``OUTBOX_EXPLORE_*``, set by
:mod:`.world`). Each send's answer is drawn at once from the schedule, the event and its
attempt: when the receiver gets it (latency, a slow send, a freeze), and what it says
(delivered, a transient failure, a refusal). An answer later than the delivery timeout is a
timeout for the relay; the receiver may still get the event afterwards (a slow ack after the
relay gave up). What the receiver gets is written to the journal when the event is sent, with
the time it gets it, so a relay killed meanwhile loses none of it, as a real receiver would not.

With ``signals`` (a seed's bit), a thread of the sink sets its ``wake`` when the next answer is
due, as Kafka's report thread does; else the relay finds answers only by polling.

Sends go through at most ``concurrency`` slots (a client's worker pool): the rest queue, and
the delivery timeout counts from the hand-over, queue included. ``chained`` sends are
concurrent (the relay chains a key's events, as for webhooks); ``ordered`` ones go through a
queue per key, as a Kafka partition does: an event sent behind a failing one of its key fails
with it, and so does one sent after the failure but before the relay was told of it (the
promise a sink that keeps a key's order makes the relay: it holds the key once it knows).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
import random
import threading
import time
from typing import Any

from outbox.events import ClaimedEvent
from outbox.sinks.base import Dead, Delivered, Outcome, Report, Retry
from outbox_bench.explore.schedule import Schedule

ENV_SCHEDULE = "OUTBOX_EXPLORE_SCHEDULE"  # the schedule, as JSON
ENV_JOURNAL = "OUTBOX_EXPLORE_JOURNAL"  # the directory of the journals
ENV_T0 = "OUTBOX_EXPLORE_T0"  # a file: the schedule's time 0 (seconds since the epoch)
ENV_RELAY = "OUTBOX_EXPLORE_RELAY"  # which relay of the schedule this process is
TWIN_TOPIC = "twin.events"  # the twin outboxes' events (schedule.twins): delivered at once, no journal


class ScriptedSink:
    def __init__(self, schedule: Schedule, journal: str, t0: str, relay: int) -> None:
        self.schedule = schedule
        self._t0_file = t0
        self._t0: float | None = None
        self.relay = relay
        self.keeps_key_order = schedule.sink_order == "ordered"
        path = os.path.join(journal, f"relay{relay}-{os.getpid()}.jsonl")
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        # (answer at, seq, report, outcome, the key whose unreported failure it is, or None)
        self._pending: list[tuple[float, int, Report, Outcome, bytes | None]] = []
        self._seq = itertools.count()
        self._sends: dict[int, int] = {}  # n -> sends of it by this process
        self._queues: dict[bytes, tuple[float, bool]] = {}  # ordered: key -> (last answer at, failed)
        self._unreported: dict[bytes, int] = {}  # ordered: key -> its failures not reported yet
        self._slots: list[float] = [0.0] * schedule.concurrency  # when each send slot is free again
        self._closed = False
        if schedule.signals:
            self.wake = threading.Event()  # Signals: set when an answer is due
            self._pushed = threading.Event()  # an answer was scheduled: the waker looks again
            threading.Thread(target=self._wake_when_due, name="scripted-sink-waker", daemon=True).start()

    def _wake_when_due(self) -> None:
        """Set ``wake`` when the earliest scheduled answer is due (its thread)."""
        while not self._closed:
            self._pushed.clear()  # first: an answer scheduled after this sets it again
            try:
                due = self._pending[0][0]
            except IndexError:
                due = None
            now = time.time()
            if due is not None and due <= now:
                self.wake.set()
                self._pushed.wait(0.001)  # until the relay takes it (or another is scheduled)
            else:
                self._pushed.wait(None if due is None else due - now)

    @property
    def t0(self) -> float:
        """Written by the explorer before its writer starts: there is no event to send before."""
        if self._t0 is None:
            with open(self._t0_file) as f:
                self._t0 = float(f.read())
        return self._t0

    # -- the sink protocol ---------------------------------------------------------

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        if event.topic == TWIN_TOPIC:
            return Delivered()
        s = self.schedule
        now = time.time()
        body: dict[str, Any] = json.loads(event.payload)
        n = int(body["n"])
        tries = self._sends.get(n, 0)
        self._sends[n] = tries + 1
        rng = random.Random(f"{s.seed}/{n}/{event.attempts}/{tries}")
        queued = now
        if self._slots:  # it waits for a free slot, as a client's worker pool makes it
            now = max(now, heapq.heappop(self._slots))
        rel = now - self.t0
        if rng.random() < s.slow:
            took = rng.uniform(0.3, 1.6) * s.delivery_timeout
        else:
            took = math.exp(rng.gauss(math.log(s.latency_ms / 1000), s.spread))
        answer = now + took
        for z in s.freezes:
            if z.at <= rel < z.at + z.lasts:
                answer = max(answer, self.t0 + z.at + z.lasts)
        draw = rng.random()
        outcome: Outcome
        if draw < s.refuse and rel < s.refuse_until:
            outcome, what = Dead("refused", "the receiver refused it"), "refused"
        elif s.refuse <= draw < s.refuse + s.fail:
            outcome, what = Retry("http_503", "the receiver failed"), "failed"
        else:
            outcome, what = Delivered(), "delivered"
        if self.keeps_key_order and event.key is not None:
            last, failed = self._queues.get(event.key, (0.0, False))
            if last > now:  # behind an event of its key not answered yet
                answer = max(answer, last)
            # Behind a failure of its key that the relay has not been told of yet (a failure fails
            # the ones behind it: what a sink that keeps a key's order promises the relay).
            if (last > now and failed) or self._unreported.get(event.key, 0):
                outcome, what = Retry("queue_failed", "an earlier event of its key failed"), "failed"
        late = False
        sent = now < queued + s.delivery_timeout  # else the client dropped it from its queue, unsent
        if answer - queued > s.delivery_timeout:  # the relay gives up on it (queued time counts)
            late = sent and what == "delivered" and rng.random() < s.late
            what = "delivered" if late else "timeout"
            outcome = Retry("timeout", "no answer within the delivery timeout")
            replied = queued + s.delivery_timeout
        else:
            replied = answer
        if self.keeps_key_order and event.key is not None:
            self._queues[event.key] = (answer, not isinstance(outcome, Delivered))
        if s.concurrency:
            heapq.heappush(self._slots, replied if sent else now)
        self._journal(
            {"t": answer, "n": n, "id": event.id, "what": what, "late": late, "attempts": event.attempts,
             "sent": now, "replied": replied, "key": (event.key or b"").decode()}
        )  # fmt: skip
        failing = None
        if self.keeps_key_order and event.key is not None and not isinstance(outcome, Delivered):
            failing = event.key
            self._unreported[failing] = self._unreported.get(failing, 0) + 1
        heapq.heappush(self._pending, (replied, next(self._seq), report, outcome, failing))
        if self.schedule.signals:
            self._pushed.set()
        return None

    def poll(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        ready: list[tuple[Report, Outcome]] = []
        while True:
            now = time.time()
            while self._pending and self._pending[0][0] <= now:
                _, _, report, outcome, failing = heapq.heappop(self._pending)
                ready.append((report, outcome))
                if failing is not None:
                    self._unreported[failing] -= 1
            left = deadline - time.monotonic()
            if ready or left <= 0:
                break
            time.sleep(min(left, self._pending[0][0] - now if self._pending else left))
        for report, outcome in ready:
            report(outcome)
        return len(ready)

    def flush(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            self.poll(deadline - time.monotonic())
        return len(self._pending)

    def healthy(self) -> bool:
        return True

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        self._pending.clear()
        self._closed = True
        if self.schedule.signals:
            self._pushed.set()

    def _journal(self, record: dict[str, Any]) -> None:
        record["relay"] = self.relay
        record["pid"] = os.getpid()
        os.write(self._fd, (json.dumps(record) + "\n").encode())


def scripted(_bootstrap: str, _config: dict[str, str], _timeout: float) -> ScriptedSink:
    """``--sink outbox_bench.explore.sink:scripted``: the sink of the schedule in the environment."""
    with open(os.environ[ENV_SCHEDULE]) as f:
        schedule = Schedule.from_json(f.read())
    return ScriptedSink(schedule, os.environ[ENV_JOURNAL], os.environ[ENV_T0], int(os.environ[ENV_RELAY]))
