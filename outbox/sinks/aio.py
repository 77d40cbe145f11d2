"""The base of the sinks whose clients are asyncio (RabbitMQ, NATS, Redis, webhooks).

The relay's loop is synchronous and single-threaded; these clients are not. Each
sink runs its client on its own event loop in a daemon thread:

- ``produce`` (relay thread) queues the event; ``poll``, which the relay calls
  right after handing over a batch and whenever it waits, wakes the loop for
  the queued burst (one ``call_soon_threadsafe`` per burst, not per event, and
  the loop takes the whole burst: a batch is not split by the loop thread
  waking up half-way through it);
- the loop hands the burst to :meth:`AsyncSink.dispatch`, which starts one
  task per event with one timer for the whole burst (RabbitMQ: concurrent
  publishes, confirms in batches), or a pool of workers (webhooks: at most 100
  requests at once), or one task per burst (Redis: a pipeline; NATS: publishes
  settled from their acks on a reply subscription);
- each outcome goes back through a queue; ``poll`` (relay thread) serves the
  reports and waits on :attr:`AsyncSink.wake`, which a :class:`Router` shares
  among its sinks. The loop sets it when it has nothing left to report, when
  :data:`REPORTS_PER_WAKE` outcomes are queued, or :data:`REPORT_DELAY` after
  the first one, whichever comes first.

Connections: :meth:`AsyncSink.client` opens the connection on first use and
again after it was lost. While the sink is down, sends fail at once with
``Retry("unavailable")`` until the next reconnect attempt is due (backoff from
0.5 s to 5 s), so a down RabbitMQ costs the relay nothing and never stalls the
other routes. The outage is one :class:`~outbox.observe.conditions.Condition` per sink:
one line when it starts, a summary a minute, one line when a send succeeds.

These sinks cannot keep several in-flight events of one key in order (a later
publish may succeed where an earlier one failed), so ``keeps_key_order`` is
False and the router wraps them in :class:`~outbox.sinks.chains.KeyChains`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar

from outbox.events import KEY_HEADER, ClaimedEvent
from outbox.observe.conditions import Condition
from outbox.sinks.base import Dead, Outcome, Report, Retry
from outbox.sinks.routes import SinkURL

log = logging.getLogger("outbox.sinks")

RECONNECT_MIN = 0.5  # seconds before the first reconnect attempt after a failure
RECONNECT_MAX = 5.0  # seconds, at most, between reconnect attempts
CLOSE_WAIT = 2.0  # seconds for the client to close and the loop thread to end

# The relay's thread is woken for outcomes when the loop has none left to report, when this
# many are queued, or this many seconds after the first one: not for every confirm that
# trickles in (RabbitMQ acks a few messages at a time), since each wake-up hands the GIL
# over and back and sends the key chains' next events as a burst of a handful.
REPORTS_PER_WAKE = 500
REPORT_DELAY = 0.002
UNAVAILABLE = "unavailable"  # the error kind of a send refused because the sink is down
TIMEOUT = "timeout"  # ... of a send the sink did not confirm in time


class Unavailable(Exception):
    """The sink cannot be reached now; the event is retried."""


class Refused(Exception):
    """The sink refused the event for good: it becomes a dead letter with ``kind``."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(reason)
        self.kind = kind


Item = tuple[ClaimedEvent, Report]


def as_bytes(value: str | bytes | None) -> bytes:
    """A header value as bytes (decoded rows always hold bytes; custom callers may not)."""
    return value if isinstance(value, bytes) else (value or "").encode("utf-8")


def text_headers(event: ClaimedEvent) -> dict[str, str]:
    """The event's headers as text, ``event-key`` included (when the key is not null), or
    Refused naming the first one that cannot be one line of UTF-8 text."""
    items = event.headers if event.key is None else [*event.headers, (KEY_HEADER, event.key)]
    headers: dict[str, str] = {}
    for name, value in items:
        try:
            text = as_bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            text = "\n"  # refused below, like a line break
        if "\n" in text or "\r" in text or "\0" in text:
            raise Refused(
                "invalid_header",
                f"header {name!r}: the value is not one line of UTF-8 text, which this sink's "
                "protocol requires",
            )
        headers[name] = text
    return headers


def cancel_unfinished(tasks: list[asyncio.Task[None]] | list[asyncio.Future[Any]]) -> None:
    for task in tasks:
        if not task.done():
            task.cancel()


class AsyncSink:
    """A sink whose client runs on an asyncio loop in a side thread. Subclasses implement
    :meth:`deliver` (one event) or :meth:`dispatch` (a burst), and :meth:`connect` /
    :meth:`disconnect` when they keep a connection."""

    scheme: ClassVar[str] = ""
    system: ClassVar[str] = ""  # the system as OpenTelemetry names it
    default_port: ClassVar[int] = 0  # the port when the URL names none
    keeps_key_order = False

    def __init__(self, url: SinkURL, *, timeout: float) -> None:
        self.url = url
        self.name = url.display
        self.timeout = timeout
        self.wake = threading.Event()  # set when reports are ready (a Router shares one)
        self._secrets = url.hidden  # masked in every error's text (clean)
        self._incoming: deque[Item] = deque()
        self._reports: deque[tuple[Report, Outcome]] = deque()
        self._pending = 0  # produced and not yet reported (relay thread only)
        self._lock = threading.Lock()
        self._scheduled = False
        self._unreported = 0  # taken by the loop and not yet reported (loop thread)
        self._announcing = False
        self._conn: Any = None
        self._connecting: asyncio.Task[Any] | None = None
        self._reconnect_at = 0.0
        self._backoff = RECONNECT_MIN
        self._down_reason = ""
        self._probe: concurrent.futures.Future[None] | None = None  # a reconnect while down
        self._confirmed_at = time.monotonic()  # the last confirmed send (loop thread)
        self.condition = Condition(log, self.scheme, f"cannot reach {self.name}")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"outbox-sink-{self.scheme}", daemon=True
        )
        self._thread.start()

    # -- relay thread -------------------------------------------------------------

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        """Queue ``event``; the next :meth:`poll` hands the queued burst to the loop."""
        self._pending += 1
        self._incoming.append((event, report))
        return None

    def _send(self) -> None:
        """Wake the loop for what :meth:`produce` queued (once per burst: one
        ``call_soon_threadsafe``, and the loop takes the whole burst at once)."""
        if not self._incoming:
            return
        with self._lock:
            if self._scheduled:
                return
            self._scheduled = True
        self._loop.call_soon_threadsafe(self._take)

    def poll(self, timeout: float) -> int:
        reports = self._reports
        self._send()
        if timeout > 0:
            if not reports:
                self.wake.wait(timeout)
            # Before draining: a report queued after this sets it again. With timeout 0 a
            # Router is polling (it clears its shared wake-up itself, before polling them all).
            self.wake.clear()
        served = 0
        while reports:
            report, outcome = reports.popleft()
            self._pending -= 1
            report(outcome)
            served += 1
        if served:
            self._send()  # what the reports produced (the next event of a key chain)
        return served

    def flush(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while self._pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.poll(min(left, 0.05))
        return self._pending

    def healthy(self) -> bool:
        return self._thread.is_alive()

    def probe(self) -> None:
        """While the sink counts as down, connect again (on its loop, not waiting): a connection
        that opens ends the outage before any event is due again."""
        if not self.condition.active or not self._loop.is_running():
            return
        if self._probe is not None and self._probe.done():
            if not self._probe.cancelled() and self._probe.exception() is None and self.condition.active:
                self._loop.call_soon_threadsafe(self.confirmed)
            self._probe = None
        if self._probe is None:
            self._probe = asyncio.run_coroutine_threadsafe(self._reachable(), self._loop)

    async def _reachable(self) -> None:
        self._reconnect_at = 0.0  # a probe does not wait out the reconnect backoff
        await asyncio.wait_for(self.reachable(), self.timeout)

    async def reachable(self) -> None:
        """Raise unless the sink answers now (a probe while it counts as down): a connection
        that opens, by default; a sink whose client connects lazily asks something."""
        await self.client()

    def trouble(self) -> str | None:
        """Why the sink is down now, or None (for /readyz)."""
        c = self.condition
        return f"{c.description} for {c.seconds():.0f} s: {c.last_error}" if c.active else None

    def close(self, timeout: float) -> None:
        remaining = self.flush(timeout)
        if remaining:
            log.warning("closing %s with %d events unconfirmed", self.name, remaining)
        if self._loop.is_running():
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            try:
                done.result(CLOSE_WAIT)
            except Exception as exc:  # closing must not fail the relay's shutdown
                log.debug("closing %s: %s", self.name, self.clean(exc))
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_WAIT)
        if not self._thread.is_alive():
            self._loop.close()

    # -- loop thread --------------------------------------------------------------

    def _take(self) -> None:
        with self._lock:
            self._scheduled = False
        incoming = self._incoming
        items = [incoming.popleft() for _ in range(len(incoming))]
        if items:
            self._unreported += len(items)
            self.dispatch(items)

    def dispatch(self, items: list[Item]) -> None:
        """Start sending a burst of events: one task per event, one timer for the burst (what
        is not done when it fires is cancelled and reported as a timeout)."""
        create_task, send = self._loop.create_task, self.send_one
        tasks = [create_task(send(event, report)) for event, report in items]
        self._loop.call_later(self.timeout, cancel_unfinished, tasks)

    async def send_one(self, event: ClaimedEvent, report: Report) -> None:
        """:meth:`deliver` ``event`` and queue its outcome (a task that reports itself: no
        done-callback per event). Cancelled, it reports a timeout."""
        try:
            outcome = await self.deliver(event)
        except asyncio.CancelledError:
            self.done(report, Retry(TIMEOUT, f"{self.name} did not confirm within {self.timeout:g} s"))
            self.timed_out()
            raise
        except Exception as exc:
            outcome = self.failure(exc)
        self.done(report, outcome)

    async def attempt(self, sending: Any) -> Any:
        """Await ``sending`` within the timeout; a failure becomes its outcome (:meth:`failure`)."""
        try:
            return await asyncio.wait_for(sending, self.timeout)
        except Exception as exc:
            return self.failure(exc)

    def failure(self, exc: Exception) -> Outcome:
        """The outcome of a send that raised ``exc`` (loop thread)."""
        if isinstance(exc, Unavailable):
            return Retry(UNAVAILABLE, str(exc))
        if isinstance(exc, asyncio.TimeoutError):
            self.timed_out()
            return Retry(TIMEOUT, f"{self.name} did not confirm within {self.timeout:g} s")
        if isinstance(exc, Refused):
            return Dead(exc.kind, str(exc))
        if isinstance(exc, (TypeError, ValueError)):  # the client cannot encode this event
            return Dead("client_rejected", f"rejected by the {self.scheme} client: {self.clean(exc)}")
        log.warning("%s: unexpected %s: %s", self.name, type(exc).__name__, self.clean(exc))
        return Retry(type(exc).__name__, f"{self.name}: {self.clean(exc)}")

    def done(self, report: Report, outcome: Outcome) -> None:
        """Queue ``outcome`` for the relay thread (loop thread)."""
        self._reports.append((report, outcome))
        self._unreported -= 1
        self._announce()

    def done_many(self, reports: Iterable[tuple[Report, Outcome]]) -> None:
        items = list(reports)
        self._reports.extend(items)
        self._unreported -= len(items)
        self._announce()

    def _announce(self) -> None:
        if self.wake.is_set():
            return
        if self._unreported <= 0 or len(self._reports) >= REPORTS_PER_WAKE:
            self.wake.set()  # after the append: a poll that cleared it first sees the report
        elif not self._announcing:
            self._announcing = True
            self._loop.call_later(REPORT_DELAY, self._announce_late)

    def _announce_late(self) -> None:
        self._announcing = False
        if self._reports and not self.wake.is_set():
            self.wake.set()

    def confirmed(self) -> None:
        """A send succeeded: the sink is up (loop thread)."""
        self._confirmed_at = time.monotonic()
        if self.condition.active:
            self.condition.ok()

    def quiet_for(self) -> float:
        """Seconds since the last confirmed send (loop thread)."""
        return time.monotonic() - self._confirmed_at

    def timed_out(self) -> None:
        """A send got no answer in time (loop thread). If nothing at all was confirmed for as
        long, the connection is silent (a blackhole, a half-open connection): drop it and count
        the sink down, rather than send into it again."""
        if time.monotonic() - self._confirmed_at >= self.timeout and not self.condition.active:
            self.lost(f"nothing confirmed for {self.timeout:g} s: the connection is silent")

    async def client(self) -> Any:
        """The open connection: opened now if needed, or Unavailable while reconnecting waits."""
        if self._conn is not None:
            return self._conn
        if time.monotonic() < self._reconnect_at:
            raise Unavailable(self._down_reason)
        if self._connecting is None:
            self._connecting = self._loop.create_task(self._open())
            # Its failure is read by whoever awaits it; if they all gave up (a send's own
            # timeout), asyncio logged "Task exception was never retrieved" with a traceback,
            # for an outage the condition has already said in one line.
            self._connecting.add_done_callback(_retrieved)
        return await asyncio.shield(self._connecting)

    async def _open(self) -> Any:
        try:
            conn = await asyncio.wait_for(self.connect(), self.timeout)
        except Exception as exc:
            why = "timed out" if isinstance(exc, asyncio.TimeoutError) else self.clean(exc)
            self._down(f"connect failed: {why}")
            raise Unavailable(self._down_reason) from None
        finally:
            self._connecting = None
        self._conn = conn
        self._backoff = RECONNECT_MIN
        return conn

    def lost(self, why: str) -> None:
        """The connection broke: drop it; the next send reconnects (loop thread)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._loop.create_task(self._quietly_disconnect(conn))
        self._down(why)

    def _down(self, reason: str) -> None:
        self._down_reason = f"cannot reach {self.name}: {reason}"
        self._reconnect_at = time.monotonic() + self._backoff
        self._backoff = min(RECONNECT_MAX, self._backoff * 2)
        self.condition.fail(reason)

    async def _quietly_disconnect(self, conn: Any) -> None:
        try:
            await asyncio.wait_for(self.disconnect(conn), CLOSE_WAIT)
        except Exception as exc:
            log.debug("closing a broken %s connection: %s", self.scheme, self.clean(exc))

    async def _shutdown(self) -> None:
        me = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks(self._loop) if t is not me]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        conn, self._conn = self._conn, None  # first: closing it is not an outage
        if conn is not None:
            await self._quietly_disconnect(conn)

    def clean(self, exc: BaseException | str) -> str:
        """An error's text with the URL's password (and the URL itself) masked."""
        text = str(exc) or type(exc).__name__
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    # -- what a sink implements ------------------------------------------------------

    async def deliver(self, event: ClaimedEvent) -> Outcome:
        raise NotImplementedError

    async def connect(self) -> Any:
        raise NotImplementedError

    async def disconnect(self, conn: Any) -> None:
        return None

    def span_shape(self, topic: str) -> tuple[str, dict[str, Any]]:
        """The span name and attributes of a batch sent to ``topic``: OpenTelemetry's messaging
        conventions (NATS uses these as they are; a sink with other conventions overrides it)."""
        return f"send {topic}", {
            "messaging.system": self.system,
            "messaging.destination.name": topic,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "server.address": self.url.parts.hostname or "",
            "server.port": self.url.parts.port or self.default_port,
        }


def _retrieved(task: asyncio.Task[Any]) -> None:
    """Mark a finished task's exception as read (the caller that wanted it may be gone)."""
    if not task.cancelled():
        task.exception()
