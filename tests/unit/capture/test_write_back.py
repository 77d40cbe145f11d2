"""A WAL batch's write-back, pure parts: statements of a bounded size, and a refused row's field
found by trying it without each."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pytest

from outbox.capture import wal_message, write_back
from outbox.capture.write_back import NEUTRAL_FIELDS
from outbox.events import ClaimedEvent, encode_event

LATER = datetime(2999, 1, 1, tzinfo=timezone.utc)


def _stored(sizes: list[int]) -> list[ClaimedEvent]:
    return [
        wal_message.decode(
            b"1\n"
            + wal_message.encode(
                encode_event("t", b"x" * n, key=b"k", type="order", subject="s", expires_at=LATER)
            )
        )[0]
        for n in sizes
    ]


def test_a_write_back_binds_a_bounded_number_of_bytes_a_statement(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three events of 380 MB (a stranger's, or a writer's) were bound as one array, over the
    1 GB PostgreSQL takes in a message: the rows go in runs under WRITE_BACK_BYTES, in order, at
    least one a run; a batch under it (nearly always) is one run."""
    stored = _stored([10, 10, 10])
    assert [list(p) for p in write_back.parts(stored, range(3), [0, 1, 2])] == [[0, 1, 2]]
    monkeypatch.setattr(write_back, "WRITE_BACK_BYTES", 100)
    stored = _stored([60, 30, 30, 500, 5])
    parts = [list(p) for p in write_back.parts(stored, range(5), [0, 1, 2, 3, 4])]
    assert parts == [[0, 1], [2], [3], [4]]
    assert [list(p) for p in write_back.parts(stored, range(2), [3, 4])] == [
        [0],
        [1],
    ]  # positions of the indexes given


@pytest.mark.parametrize("field", NEUTRAL_FIELDS)
def test_a_row_without_a_field_keeps_every_other(field: str) -> None:
    (before,) = _stored([4])
    b: Any = before
    event, text = write_back.without(before, '{"h":"v"}', field)
    changed = {
        f
        for f in ("key", "expires_at", "type", "subject", "topic", "payload")
        if getattr(event, f) != getattr(b, f)
    }
    assert changed == ({field} if field != "headers" else set())
    assert (text is None) == (field == "headers")
    assert event.event_id == before.event_id and event.created_at == before.created_at
    every, text = write_back.without(before, '{"h":"v"}', "every field")
    assert (every.key, every.topic, every.payload, text) == (None, "(corrupt)", b"", None)
