"""The transform the drain's ``relay_transform`` contender runs (``--transform '*=...:noop'``):
it returns each event as it came, so the race measures what a transform costs the relay itself
(an ``outbox.Event`` made per event, the call, the check of what came back), not the function's
own work."""

from __future__ import annotations

from outbox.transform.event import Event


def noop(event: Event) -> Event:
    """Each event unchanged."""
    return event
