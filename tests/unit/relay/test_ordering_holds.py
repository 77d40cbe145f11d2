"""outbox.ordering: key holds and fair shares (pure)."""

from __future__ import annotations

import uuid

from outbox.capture import Position
from outbox.relay.batch import Batch, WalBatch
from outbox.relay.ordering import KeyHolds, fair_share
from outbox.sinks.base import HELD, Dead, Delivered, Retry


class _Conn:  # Batch only stores its connection until finish()
    pass


def _rows(keys: list[bytes | None]) -> list[tuple[object, ...]]:
    return [
        (i, str(uuid.uuid4()), "t", k, b"p", None, 1_700_000_000.0, 0, None, None) for i, k in enumerate(keys)
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
    wal = WalBatch(_Conn(), _rows([b"w"]), Position(), holds=holds)  # type: ignore[arg-type]
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
