"""Per-key chains: one event of a key in flight; a failure holds the ones queued behind it."""

from __future__ import annotations

from outbox.events import ClaimedEvent
from outbox.sinks.base import HELD, Dead, Delivered, Outcome, Report, Retry
from outbox.sinks.chains import KeyChains


class _Manual:
    """A sink whose reports the test sends by hand, in any order."""

    def __init__(self) -> None:
        self.sent: list[int] = []
        self.reports: dict[int, Report] = {}

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        self.sent.append(event.id)
        self.reports[event.id] = report
        return None

    def answer(self, event_id: int, outcome: Outcome) -> None:
        self.reports.pop(event_id)(outcome)

    def poll(self, timeout: float) -> int:
        return 0

    def flush(self, timeout: float) -> int:
        return len(self.reports)

    def healthy(self) -> bool:
        return True

    def close(self, timeout: float) -> None:
        pass


def _event(event_id: int, key: bytes | None) -> ClaimedEvent:
    return ClaimedEvent(event_id, str(event_id), "t", key, b"", [], 0.0, 0)


def _chains(parks: bool = True) -> tuple[KeyChains, _Manual, dict[int, Outcome]]:
    inner = _Manual()
    got: dict[int, Outcome] = {}
    return KeyChains(inner, parks=parks), inner, got


def _produce(chains: KeyChains, got: dict[int, Outcome], event_id: int, key: bytes | None) -> None:
    outcome = chains.produce(_event(event_id, key), lambda o: got.__setitem__(event_id, o))
    if outcome is not None:
        got[event_id] = outcome


def test_one_event_per_key_in_flight_many_keys_at_once() -> None:
    chains, inner, got = _chains()
    for event_id, key in [(1, b"a"), (2, b"b"), (3, b"a"), (4, None), (5, b"a"), (6, None)]:
        _produce(chains, got, event_id, key)
    assert inner.sent == [1, 2, 4, 6]  # a's later events wait; keyless events are never chained
    assert chains.queued() == 2
    inner.answer(1, Delivered())
    assert inner.sent[-1] == 3 and got[1] == Delivered()
    inner.answer(3, Delivered())
    inner.answer(5, Delivered())
    assert inner.sent == [1, 2, 4, 6, 3, 5] and chains.queued() == 0


def test_a_retry_holds_every_event_queued_behind_it_and_frees_the_key() -> None:
    chains, inner, got = _chains()
    for event_id in (1, 2, 3):
        _produce(chains, got, event_id, b"k")
    inner.answer(1, Retry("x", "down"))
    assert got == {1: Retry("x", "down"), 2: HELD, 3: HELD}
    assert inner.sent == [1] and chains.queued() == 0
    _produce(chains, got, 4, b"k")  # a later batch may send the key again (the relay decides)
    assert inner.sent == [1, 4]


def test_a_dead_letter_holds_the_key_only_when_it_parks() -> None:
    for parks, expected in ((True, HELD), (False, Delivered())):
        chains, inner, got = _chains(parks)
        _produce(chains, got, 1, b"k")
        _produce(chains, got, 2, b"k")
        inner.answer(1, Dead("too_large", "no"))
        if not parks:
            assert inner.sent == [1, 2]
            inner.answer(2, Delivered())
        assert got[2] == expected


def test_an_outcome_known_at_once_moves_the_chain_on() -> None:
    class _Refusing(_Manual):
        def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
            if event.id != 2:
                return super().produce(event, report)
            self.sent.append(event.id)
            return Dead("bad", "refused")

    inner = _Refusing()
    chains = KeyChains(inner, parks=False)
    got: dict[int, Outcome] = {}
    for event_id in (1, 2, 3):
        _produce(chains, got, event_id, b"k")
    inner.answer(1, Delivered())  # 2 is refused at once, 3 goes out
    assert got[2] == Dead("bad", "refused") and inner.sent == [1, 2, 3]


def _routed(ordered_topics: set[str]) -> tuple[KeyChains, _Manual, dict[int, Outcome]]:
    """Chains across sinks: an event's topic is its sink; the topics in ``ordered_topics`` go to a
    sink that keeps a key's in-flight order (Kafka)."""
    inner = _Manual()
    route = lambda e: (e.topic, e.topic in ordered_topics)  # noqa: E731
    return KeyChains(inner, parks=True, route=route), inner, {}


def _to(chains: KeyChains, got: dict[int, Outcome], event_id: int, topic: str, key: bytes | None) -> None:
    event = ClaimedEvent(event_id, str(event_id), topic, key, b"", [], 0.0, 0)
    outcome = chains.produce(event, lambda o: got.__setitem__(event_id, o))
    if outcome is not None:
        got[event_id] = outcome


def test_across_sinks_a_key_waits_for_its_events_in_flight_to_another_sink() -> None:
    chains, inner, got = _routed({"kafka"})
    _to(chains, got, 1, "kafka", b"k")
    _to(chains, got, 2, "kafka", b"k")  # the same ordered sink: in flight beside 1
    _to(chains, got, 3, "amqp", b"k")  # another sink: waits for 1 and 2
    _to(chains, got, 4, "amqp", b"j")  # another key: at once
    assert inner.sent == [1, 2, 4] and chains.queued() == 1
    inner.answer(1, Delivered())
    assert inner.sent == [1, 2, 4]  # 2 is still in flight
    inner.answer(2, Delivered())
    assert inner.sent == [1, 2, 4, 3]
    _to(chains, got, 5, "amqp", b"k")  # a sink that does not keep order: one at a time
    assert inner.sent == [1, 2, 4, 3]
    inner.answer(3, Delivered())
    assert inner.sent == [1, 2, 4, 3, 5]


def test_across_sinks_a_failure_holds_the_key_on_every_sink() -> None:
    """The race the router had: the failure of a key's event to RabbitMQ came back after the
    key's next event had gone to Kafka, which then overtook it."""
    chains, inner, got = _routed({"kafka"})
    _to(chains, got, 1, "amqp", b"k")
    _to(chains, got, 2, "kafka", b"k")
    _to(chains, got, 3, "kafka", b"k")
    assert inner.sent == [1]
    inner.answer(1, Retry("unavailable", "down"))
    assert got == {1: Retry("unavailable", "down"), 2: HELD, 3: HELD} and inner.sent == [1]
    assert chains.queued() == 0


def test_across_sinks_the_queue_drains_in_order_through_sends_that_join() -> None:
    chains, inner, got = _routed({"kafka"})
    for event_id, topic in [(1, "amqp"), (2, "kafka"), (3, "kafka"), (4, "amqp"), (5, "kafka")]:
        _to(chains, got, event_id, topic, b"k")
    inner.answer(1, Delivered())
    assert inner.sent == [1, 2, 3]  # 2 and 3 together to the ordered sink; 4 waits for both
    inner.answer(2, Delivered())
    inner.answer(3, Delivered())
    assert inner.sent == [1, 2, 3, 4]
    inner.answer(4, Delivered())
    inner.answer(5, Delivered())
    assert inner.sent == [1, 2, 3, 4, 5] and chains.queued() == 0 and len(got) == 5
