"""The pure parts of the sinks: signing, Retry-After, header encodings, route URLs."""

from __future__ import annotations

import asyncio
import base64
import json
import threading
import time
from email.utils import formatdate

import pytest

from outbox.errors import ConfigError
from outbox.events import ClaimedEvent
from outbox.sinks.aio import REPORT_DELAY, AsyncSink, Refused, text_headers
from outbox.sinks.base import Delivered, Outcome
from outbox.sinks.redis import fields, headers_json
from outbox.sinks.routes import parse_route, parse_url
from outbox.sinks.signing import parse_secrets, signature
from outbox.sinks.webhook import retry_after


def _event(headers: list[tuple[str, str | bytes | None]], key: bytes | None = b"k") -> ClaimedEvent:
    return ClaimedEvent(1, "e-1", "t", key, b"p", [*headers, ("event-id", b"e-1")], 0.0, 0)


def test_the_signature_matches_the_standard_webhooks_example() -> None:
    """The example of the Standard Webhooks specification."""
    keys = parse_secrets("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw")
    sig = signature(keys, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, b'{"test": 2432232314}')
    assert sig == "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def _whsec(raw: bytes) -> str:
    return "whsec_" + base64.b64encode(raw).decode()


def test_several_secrets_give_one_signature_each_and_bad_ones_are_named_not_shown() -> None:
    a, b = b"a" * 24, b"b" * 64
    keys = parse_secrets(_whsec(a) + "  " + _whsec(b))
    assert keys == [a, b] and len(signature(keys, "id", 1, b"x").split(" ")) == 2
    for bad, why in (
        ("s3cr3t", "does not start with 'whsec_'"),
        ("whsec_%%%", "not whsec_ followed by base64"),
        (_whsec(b"k" * 23), "is 23 bytes; Standard Webhooks secrets are 24 to 64 bytes"),
        (_whsec(b"k" * 65), "is 65 bytes; Standard Webhooks secrets are 24 to 64 bytes"),
        ("whsec_", "is 0 bytes"),
    ):
        with pytest.raises(ConfigError) as err:
            parse_secrets(f"{_whsec(a)} {bad}")
        text = str(err.value)
        assert "secret 2" in text and why in text and "\n" not in text, text
        assert bad.removeprefix("whsec_") not in text or bad == "whsec_"  # never the secret


def test_retry_after_takes_seconds_or_a_date() -> None:
    assert retry_after("120") == 120.0
    assert retry_after(None) is None and retry_after("soon") is None
    later = retry_after(formatdate(time.time() + 30, usegmt=True))
    assert later is not None and 25 < later <= 30
    assert retry_after(formatdate(time.time() - 30, usegmt=True)) == 0.0
    # A receiver's header is anything: "²" is a digit to str.isdigit and no number to float(), which
    # made a 503 a dead letter (client_rejected): found by the input fuzzer (tests/fuzz).
    for odd in ("\u00b2", "\u0663", "-1", "1e9", "nan", "Wed, 21 Oct 99999 07:28:00 GMT", "9" * 400):
        assert retry_after(odd) is None or retry_after(odd) == float("9" * 400), odd


def test_text_headers_carry_the_key_and_refuse_what_is_not_one_line_of_utf8() -> None:
    assert text_headers(_event([("a", b"x")])) == {"a": "x", "event-id": "e-1", "event-key": "k"}
    assert "event-key" not in text_headers(_event([], key=None))
    for value in (b"\xff", b"a\nb"):
        with pytest.raises(Refused) as err:
            text_headers(_event([("sig", value)]))
        assert err.value.kind == "invalid_header" and "'sig'" in str(err.value)


def test_redis_fields_keep_binary_header_values_as_base64_objects() -> None:
    event = _event([("text", b"caf\xc3\xa9"), ("bin", b"\xff\x00")], key=None)
    assert json.loads(headers_json(event) or "") == {"text": "café", "bin": {"base64": "/wA="}}
    f = fields(event)
    assert "key" not in f and f["event-id"] == "e-1" and f["payload"] == b"p"
    assert headers_json(_event([])) is None  # event-id is a field of its own


@pytest.mark.parametrize(
    ("route", "shown"),
    [
        ("o=amqp://u:Pw1@rabbit:5672/prod?exchange=orders", "o=amqp://rabbit:5672/prod?exchange=orders"),
        ("o=redis://:Pw1@cache:6379/2?maxlen=100", "o=redis://cache:6379/2?maxlen=100"),
        ("o=nats://u:Pw1@nats:4222", "o=nats://nats:4222"),
        ("o=https://hooks.example", "o=https://hooks.example/"),
    ],
)
def test_route_urls_are_shown_without_credentials(route: str, shown: str) -> None:
    assert parse_route(route).display == shown


def test_a_webhook_url_is_shown_without_its_path_or_query_which_may_hold_its_token() -> None:
    """A Slack-style hook's token is its path; others put it in the query. Two routes to one
    host still differ: a short digest of the whole URL (not of the token alone) stands for them."""
    slack = parse_route("o=https://hooks.slack.example/services/T01/B02/Xy7TokenPart")
    other = parse_route("p=https://u:Pw1@hooks.slack.example/in/{topic}/{key}?token=Pw2")
    for route, secrets in ((slack, ["T01", "Xy7TokenPart"]), (other, ["Pw1", "Pw2", "/in/"])):
        assert route.display.startswith(f"{route.glob}=https://hooks.slack.example/…(")
        assert not any(secret in route.display for secret in secrets), route.display
    assert slack.display.split("=")[1] != other.display.split("=")[1]
    # A client's error quoting the URL, or the rendered path's fixed pieces, shows none of it.
    masked = other.url.hidden
    text = "cannot reach https://u:Pw1@hooks.slack.example/in/orders/k?token=Pw2: refused"
    for piece in masked:
        text = text.replace(piece, "***")
    assert "Pw1" not in text and "Pw2" not in text and "/in/" not in text


@pytest.mark.parametrize(
    ("route", "error"),
    [
        ("o=amqp://rabbit:99999/", "is not a number from 0 to 65535"),
        ("o=amqp:///vhost", "names no host"),
        ("o=amqp://rabbit/?exchange=x&typo=1", "unknown option 'typo'"),
        ("o=redis://cache:6379/zero", "the database of 'redis://cache:6379/zero' must be a number"),
        ("o=redis://cache/0?maxlen=-5", "option maxlen must be a positive integer"),
    ],
)
def test_bad_route_urls_are_refused_naming_the_problem(route: str, error: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_route(route)
    assert error in str(err.value)


class _CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.times_set = 0

    def set(self) -> None:
        if not self.is_set():
            self.times_set += 1
        super().set()


class _GatedSink(AsyncSink):
    """An async sink whose sends finish when the test says (no server)."""

    scheme = "gated"

    def __init__(self) -> None:
        super().__init__(parse_url("redis://127.0.0.1:1/0", "url"), timeout=30.0)
        self.wake = _CountingEvent()
        self.gates: dict[int, asyncio.Future[None]] = {}

    async def deliver(self, event: ClaimedEvent) -> Outcome:
        gate = self.gates[event.id] = self._loop.create_future()
        await gate
        return Delivered()


def test_outcomes_trickling_in_wake_the_relay_thread_a_few_times_not_once_each() -> None:
    """200 confirms, one per loop pass (as RabbitMQ's trickle in), while a consumer
    thread drains reports as the relay's does: it is woken a handful of times, and the
    last outcome wakes it at once (nothing is left unreported, so no delay)."""
    sink = _GatedSink()
    reported: list[Outcome] = []
    stop = threading.Event()

    def relay_thread() -> None:
        while not stop.is_set():
            sink.poll(0.5)

    consumer = threading.Thread(target=relay_thread)
    consumer.start()
    try:
        for i in range(200):
            sink.produce(ClaimedEvent(i, f"e-{i}", "t", b"k", b"p", [], 0.0, 0), reported.append)
        sink.poll(0)  # hands the burst over
        while len(sink.gates) < 200:
            time.sleep(0.001)

        def release(i: int) -> None:
            time.sleep(0.0001)  # the next confirm is a moment away (the GIL is free meanwhile)
            sink.gates[i].set_result(None)
            if i + 1 < 200:
                sink._loop.call_soon(release, i + 1)

        started = time.monotonic()
        sink._loop.call_soon_threadsafe(release, 0)
        deadline = started + 10
        while len(reported) < 200 and time.monotonic() < deadline:
            time.sleep(0.001)
        took = time.monotonic() - started
    finally:
        stop.set()
        consumer.join()
        sink.close(1)
    assert len(reported) == 200 and all(isinstance(o, Delivered) for o in reported)
    # At most one wake-up per REPORT_DELAY while they trickle in (woken once per outcome, the
    # relay's thread would be woken 200 times).
    assert sink.wake.times_set <= min(100, took / REPORT_DELAY + 10), (sink.wake.times_set, took)


def test_a_sinks_batch_call_and_send_now_are_found_on_its_class_through_wrappers() -> None:
    """The batch path asks a sink's class, once: a sink with ``produce_many`` takes batches, one
    without does not, and a wrapper's ``send_now`` reaches the sink inside it."""
    from outbox.sinks.base import SinkWrapper, many_of, send_now

    class Plain:
        def produce(self, event: object, report: object) -> None: ...

    class Batching(Plain):
        sent_now = 0

        def produce_many(self, events: object, outcomes: object, settle: object) -> int:
            return 0

        def send_now(self) -> None:
            self.sent_now += 1

    batching = Batching()
    assert many_of(batching) is batching and many_of(Plain()) is None
    send_now(SinkWrapper(batching))  # type: ignore[arg-type]
    send_now(Plain())  # type: ignore[arg-type]  # (nothing to call)
    assert batching.sent_now == 1
