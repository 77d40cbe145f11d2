"""A WAL batch's write-back, pure parts: statements of a bounded size, and a refused row's field
found by trying it without each (issue 70)."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from outbox.capture import Position, wal_message
from outbox.events import encode_event
from outbox.relay import wal_batch
from outbox.relay.wal_batch import NEUTRAL_FIELDS, WalBatch

LATER = datetime(2999, 1, 1, tzinfo=timezone.utc)


def _batch(sizes: list[int]) -> WalBatch:
    rows = [
        wal_message.decode(
            b"1\n"
            + wal_message.encode(
                encode_event("t", b"x" * n, key=b"k", type="order", subject="s", expires_at=LATER)
            )
        )
        for n in sizes
    ]
    return WalBatch(None, rows, Position())  # type: ignore[arg-type]  # no statement is run here


def test_a_write_back_binds_a_bounded_number_of_bytes_a_statement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three events of 380 MB (a stranger's, or a writer's) were bound as one array, over the
    1 GB PostgreSQL takes in a message: the rows go in runs under WRITE_BACK_BYTES, in order, at
    least one a run; a batch under it (nearly always) is one run."""
    batch = _batch([10, 10, 10])
    assert [list(p) for p in batch._parts(range(3), [0, 1, 2])] == [[0, 1, 2]]
    monkeypatch.setattr(wal_batch, "WRITE_BACK_BYTES", 100)
    batch = _batch([60, 30, 30, 500, 5])
    parts = [list(p) for p in batch._parts(range(5), [0, 1, 2, 3, 4])]
    assert parts == [[0, 1], [2], [3], [4]]
    assert [list(p) for p in batch._parts(range(2), [3, 4])] == [[0], [1]]  # positions of the indexes given


@pytest.mark.parametrize("field", NEUTRAL_FIELDS)
def test_a_row_without_a_field_keeps_every_other(field: str) -> None:
    batch = _batch([4])
    batch.texts[0] = '{"h":"v"}'
    before: Any = batch.stored[0]
    event, text = batch._without(0, field)
    changed = {
        f
        for f in ("key", "expires_at", "type", "subject", "topic", "payload")
        if getattr(event, f) != getattr(before, f)
    }
    assert changed == ({field} if field != "headers" else set())
    assert (text is None) == (field == "headers")
    assert event.event_id == before.event_id and event.created_at == before.created_at
    every, text = batch._without(0, "every field")
    assert (every.key, every.topic, every.payload, text) == (None, "(corrupt)", b"", None)
