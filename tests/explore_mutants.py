"""Sinks for ``outbox relay --sink`` that load the schedule explorer's scripted sink into a relay
with a known bug put back, to show that the explorer finds it (tests/integration/bench/test_explore.py)."""

from __future__ import annotations

from outbox_bench.explore.sink import ScriptedSink, scripted

from outbox.relay.ordering import KeyHolds


def _no_skip(self: KeyHolds) -> tuple[list[bytes], list[int]]:
    return [], []


def without_skip_after(bootstrap: str, config: dict[str, str], timeout: float) -> ScriptedSink:
    """The scripted sink, in a relay whose claims no longer skip a key's events after an event a
    batch out holds locked behind a failure: the fix of KeyHolds.skip_after, reverted."""
    KeyHolds.skip_after = _no_skip  # type: ignore[method-assign]
    return scripted(bootstrap, config, timeout)
