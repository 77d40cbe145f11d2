"""A transform's spec, loading, and what it may return: pure logic (the relay's side is in
tests/integration/transform)."""

from __future__ import annotations

import dataclasses

import pytest

from outbox import Event
from outbox.errors import ConfigError
from outbox.events import EVENT_ID_HEADER, ClaimedEvent
from outbox.transform import Transform, parse_transforms
from outbox.transform.spec import TransformFailed, parse_transform

EVENT = ClaimedEvent(
    1,
    "6f0c3b9e-58a4-4b8e-9d53-2b1f9ad0b6a1",
    "orders",
    b"k1",
    b'{"n": 1}',
    [("content-type", b"application/json"), (EVENT_ID_HEADER, b"6f0c3b9e-58a4-4b8e-9d53-2b1f9ad0b6a1")],
    1_700_000_000.5,
    0,
)


def _run(target: str) -> ClaimedEvent | None:
    return parse_transform(f"*=tests.transforms:{target}").run(EVENT)


def test_the_function_sees_the_writers_headers_and_an_aware_time() -> None:
    seen: list[Event] = []
    Transform("*", "x:y", lambda e: seen.append(e) or e).run(EVENT)
    (event,) = seen
    assert dict(event.headers) == {"content-type": b"application/json"}
    assert event.created_at.tzinfo is not None and event.created_at.timestamp() == EVENT.created_at
    with pytest.raises(dataclasses.FrozenInstanceError):
        event.topic = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        event.headers["x"] = b"y"  # type: ignore[index]


def test_unchanged_is_the_same_event_and_none_drops() -> None:
    assert _run("noop") is EVENT
    assert Transform("*", "x:y", lambda e: None).run(EVENT) is None


def test_a_changed_event_keeps_its_id_header_last() -> None:
    after = Transform(
        "*", "x:y", lambda e: dataclasses.replace(e, key="k2", payload={"a": 1}, headers={"h": "v"})
    ).run(EVENT)
    assert after is not None
    assert (after.key, after.payload) == (b"k2", b'{"a":1}')
    assert after.headers == [("h", b"v"), (EVENT_ID_HEADER, EVENT.event_id.encode())]
    assert (after.id, after.event_id, after.created_at, after.topic) == (
        1,
        EVENT.event_id,
        EVENT.created_at,
        "orders",
    )


@pytest.mark.parametrize(
    ("target", "reason"),
    [
        ("steal_id", "returned an invalid event: event_id: a transform cannot change it"),
        ("bad_topic", "returned an invalid event: topic: must not be empty"),
        ("forge_header", "returned an invalid event: headers: 'event-id' is set by outbox"),
        ("not_an_event", "returned an invalid event: returned dict: expected an outbox.Event or None"),
    ],
)
def test_what_no_sink_may_take_fails_naming_the_field(target: str, reason: str) -> None:
    with pytest.raises(TransformFailed) as caught:
        _run(target)
    assert str(caught.value).startswith(f"transform tests.transforms:{target} {reason}")


def test_what_it_raises_is_the_reason_capped() -> None:
    def boom(e: Event) -> Event:
        raise RuntimeError("x" * 10_000)

    with pytest.raises(TransformFailed) as caught:
        Transform("*", "m:boom", boom).run(EVENT)
    assert str(caught.value).startswith("transform m:boom raised RuntimeError: xxx")
    assert len(str(caught.value)) < 600


@pytest.mark.parametrize(
    ("given", "error"),
    [
        ("orders.*", "--transform 'orders.*': expected GLOB=module:function"),
        ("*=tests.transforms", "--transform *=tests.transforms: expected module:function"),
        ("*=no_such_module_x:f", "--transform *=no_such_module_x:f: cannot import 'no_such_module_x'"),
        (
            "*=tests.transforms:missing",
            "--transform *=tests.transforms:missing: module 'tests.transforms' has no",
        ),
        ("*=tests.transforms:LONELY_X", "has no 'LONELY_X'"),
    ],
)
def test_a_bad_spec_is_one_error_naming_the_option(given: str, error: str) -> None:
    with pytest.raises(ConfigError, match=None) as caught:
        parse_transforms([given])
    assert error in str(caught.value)
    assert "\n" not in str(caught.value)


def test_the_first_matching_glob_wins_and_globs_are_unique() -> None:
    ts = parse_transforms(["orders.*=tests.transforms:noop *=tests.transforms:reshape"])
    assert ts.of("orders.created") is ts.transforms[0]
    assert ts.of("payments") is ts.transforms[1]
    assert not parse_transforms([])
    with pytest.raises(ConfigError, match=r"--transform \*=\.\.\.: given twice"):
        parse_transforms(["*=tests.transforms:noop", "*=tests.transforms:split"])
