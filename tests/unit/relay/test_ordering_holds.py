"""outbox.ordering: key holds and fair shares (pure)."""

from __future__ import annotations

import uuid

from outbox.capture import Position
from outbox.events import decode_row
from outbox.relay.batch import Batch
from outbox.relay.ordering import Failure, KeyHolds, fair_share
from outbox.relay.retry import RetryPolicy
from outbox.relay.wal_batch import WalBatch
from outbox.sinks.base import HELD, Dead, Delivered, Retry


class _Conn:  # Batch only stores its connection until finish()
    pass


def _rows(keys: list[bytes | None]) -> list[tuple[object, ...]]:
    return [
        (i, str(uuid.uuid4()), "t", k, b"p", None, 1_700_000_000.0, 0, None, None, None, None)
        for i, k in enumerate(keys)
    ]


def test_a_key_is_held_while_any_in_flight_batch_holds_it() -> None:
    holds = KeyHolds()
    holds.add(1, b"k")
    holds.add(2, b"k")
    holds.add(1, b"k")  # the same batch twice counts once
    assert holds.keys == {b"k": 2}
    holds.release(1)
    assert b"k" in holds.keys
    holds.release(2)
    assert holds.keys == {}
    holds.release(3)  # a batch that held nothing


def test_a_held_event_holds_its_key_and_claims_skip_what_follows_it_until_its_batch_ends() -> None:
    """A held event stays locked in its batch: claims skip its key's events after it until that
    batch ends (not before it: the failed event, retried, goes as usual); a failure holds its
    key (its later events are held as they come); a WAL batch's held event, not in the table,
    holds its key."""
    holds = KeyHolds()
    batch = Batch(_Conn(), _rows([b"k", b"j", None, b"k"]), holds=holds, parks=False)  # type: ignore[arg-type]
    batch.settle(3, HELD)
    batch.settle(0, HELD)  # the lower id of the two counts
    batch.settle(1, Retry("x", "x"))
    batch.settle(2, HELD)  # no key, no order: nothing held
    assert holds.keys == {b"j": 1} and holds.skip_after() == ([b"k"], [0])
    holds.add(7, b"k", locked=5)
    holds.release(id(batch))
    assert holds.keys == {} and holds.skip_after() == ([b"k"], [5])
    holds.release(7)
    assert holds.keys == {} and holds.skip_after() == ([], [])
    wal = WalBatch(_Conn(), [(decode_row(_rows([b"w"])[0]), None)], Position(), holds=holds)  # type: ignore[arg-type]
    wal.settle(0, HELD)
    assert holds.keys == {b"w": 1} and holds.skip_after() == ([], [])


def test_retries_hold_their_key_dead_letters_only_when_parking() -> None:
    holds = KeyHolds()
    batch = Batch(_Conn(), _rows([b"a", b"b", b"c", None]), holds=holds, parks=False)  # type: ignore[arg-type]
    batch.settle(0, Retry("x", "x"))
    batch.settle(1, Dead("x", "x"))
    batch.settle(2, Delivered())
    batch.settle(3, Retry("x", "x"))  # no key: nothing to hold
    assert set(holds.keys) == {b"a"}
    parking = Batch(_Conn(), _rows([b"d"]), holds=holds, parks=True)  # type: ignore[arg-type]
    parking.settle(0, Dead("x", "x"))
    assert set(holds.keys) == {b"a", b"d"}


def test_outcomes_after_a_release_change_nothing() -> None:
    holds = KeyHolds()
    batch = Batch(_Conn(), _rows([b"a"]), holds=holds)  # type: ignore[arg-type]
    batch.abandoned = True
    batch.settle(0, Retry("x", "x"))
    assert holds.keys == {} and batch.outcomes == [None]


def test_fair_shares_differ_by_at_most_one() -> None:
    relays = [uuid.uuid4() for _ in range(3)]
    shares = [fair_share(64, relays, r) for r in relays]
    assert sum(shares) == 64 and max(shares) - min(shares) <= 1
    assert fair_share(64, relays[:1], uuid.uuid4()) == 32  # a newcomer counts itself in


def _finished(batch: Batch) -> list[tuple[str, str]]:
    """What finishing ``batch`` reports as overtaken (its statements are not run)."""
    result, _ = batch._written(RetryPolicy(), archive=True, latencies=False)
    return result.overtaken


def test_a_key_s_event_delivered_ahead_of_an_earlier_one_to_be_retried_is_found() -> None:
    """The window of a client that times one message out and delivers the next: a key's
    event N fails while N+1, sent after it, is on its way in the same batch or a later one, and
    N+1 is delivered. Finishing the batch of N+1 names both; keys delivered in order are not."""
    holds = KeyHolds()
    first = Batch(_Conn(), _rows([b"k", b"k", b"other"]), holds=holds)  # type: ignore[arg-type]
    second = Batch(_Conn(), _rows([b"k", b"other"]), holds=holds)  # type: ignore[arg-type]
    first.settle(0, Retry("timeout", "message timed out"))
    first.settle(1, Delivered(0, 1))  # N+1, same batch: landed ahead of N
    first.settle(2, Delivered(0, 2))
    second.settle(0, Delivered(0, 3))  # N+2, sent before N failed: ahead of it too
    second.settle(1, Delivered(0, 4))
    n = first.events[0]
    assert n is not None
    assert _finished(first) == [(first.events[1].event_id, n.event_id)]  # type: ignore[union-attr]
    assert _finished(second) == [(second.events[0].event_id, n.event_id)]  # type: ignore[union-attr]
    # Claimed after the failure (the retry of N, then N+1 again): in order.
    third = Batch(_Conn(), _rows([b"k", b"k"]), holds=holds)  # type: ignore[arg-type]
    third.settle(0, Delivered(0, 5))
    third.settle(1, Delivered(0, 6))
    assert _finished(third) == []


def test_failures_without_a_later_event_delivered_are_not_violations() -> None:
    """Every event of the key after N failed too (a producer replaced: the unreported tail), or
    held; another key's delivery; the unordered mode, which keeps no watch."""
    holds = KeyHolds()
    batch = Batch(_Conn(), _rows([b"k", b"k", b"k", b"j"]), holds=holds)  # type: ignore[arg-type]
    batch.settle(0, Retry("producer_failed", "purged"))
    batch.settle(1, Retry("producer_failed", "purged"))
    batch.hold(2)
    batch.settle(3, Delivered(0, 1))
    assert _finished(batch) == []
    unordered = Batch(_Conn(), _rows([b"k", b"k"]))  # type: ignore[arg-type]
    unordered.settle(0, Retry("timeout", "x"))
    unordered.settle(1, Delivered(0, 2))
    assert _finished(unordered) == []


def test_the_watch_forgets_a_failure_after_its_horizon() -> None:
    holds = KeyHolds(horizon=10.0)
    holds.failed(b"k", Failure("e1", batch=1, place=0, last_sent=3, at=100.0))
    assert holds.overtaken(b"k", 2, 0) is not None and holds.overtaken(b"k", 4, 0) is None
    assert holds.overtaken(b"k", 1, 0) is None  # the failed event itself
    holds.failed(b"j", Failure("e2", batch=5, place=0, last_sent=5, at=200.0))
    assert set(holds.failures) == {b"j"}


def test_a_later_failure_of_the_key_after_the_first_one_s_window_is_the_one_named() -> None:
    """Event N failed (batches 1-2 could overtake it) and was retried and delivered; later event
    M of the key fails in batch 5 with batch 6 on its way: an event of batch 6 delivered overtook
    M, not N. Within the first one's window, the first stays named and its window grows."""
    holds = KeyHolds()
    holds.failed(b"k", Failure("n", batch=1, place=0, last_sent=2, at=1.0))
    holds.failed(b"k", Failure("m", batch=5, place=3, last_sent=6, at=2.0))
    earlier = holds.overtaken(b"k", 6, 0)
    assert earlier is not None and earlier.event_id == "m"
    assert holds.overtaken(b"k", 5, 1) is None  # before m in its batch
    holds.failed(b"j", Failure("a", batch=3, place=0, last_sent=4, at=3.0))
    holds.failed(b"j", Failure("b", batch=4, place=1, last_sent=7, at=3.0))  # within a's window
    earlier = holds.overtaken(b"j", 7, 0)
    assert earlier is not None and earlier.event_id == "a"
