"""outbox.ordering: key holds and fair shares (pure)."""

from __future__ import annotations

import uuid

from outbox.batch import Batch
from outbox.ordering import KeyHolds, fair_share
from outbox.sinks.base import Dead, Delivered, Retry


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


def test_the_holds_of_a_batch_that_committed_nothing_pass_to_the_batches_out_and_end_with_them() -> None:
    """A failing batch lost its lease: its keys stay held, and claims skip them, until the batches
    in flight when it ended have ended too; a batch claimed later takes no part in it."""
    holds = KeyHolds()
    holds.add(1, b"k")  # batch 1's event of k failed
    holds.add(1, b"j")
    assert holds.hand_on(1, [2, 3]) == 2  # batches 2 and 3 are out
    holds.release(1)
    assert holds.keys == {b"k": 2, b"j": 2} and holds.skipped == {b"k": 2, b"j": 2}
    holds.release(2)
    assert set(holds.skipped) == {b"k", b"j"}
    holds.release(4)  # claimed after the hand-on: it holds nothing of it
    holds.release(3)
    assert holds.keys == {} and holds.skipped == {}
    assert holds.hand_on(5, [6]) == 0  # a batch that held nothing hands nothing on
    holds.add(7, b"x")
    assert holds.hand_on(7, []) == 0 and holds.skipped == {}  # nothing out: nothing to wait for


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
