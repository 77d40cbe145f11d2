"""Transforms for tests, loaded as the relay loads them (``--transform GLOB=tests.transforms:NAME``)."""

from __future__ import annotations

import dataclasses
import json

from outbox import Event


def reshape(event: Event) -> Event | None:
    """Payload ``{"n": N, ...}``: ``drop`` -> dropped, ``boom`` -> raises; otherwise re-shaped,
    re-keyed (``new-<key>``), re-routed (``<topic>.v2``) and given a header."""
    body = json.loads(event.payload)
    if body.get("drop"):
        return None
    if body.get("boom"):
        raise ValueError(f"cannot reshape order {body['n']}")
    return dataclasses.replace(
        event,
        topic=event.topic + ".v2",
        key=None if event.key is None else b"new-" + event.key,
        payload={"order": body["n"], "version": 2},
        headers={**event.headers, "x-transformed": "yes"},
    )


def noop(event: Event) -> Event:
    return event


def steal_id(event: Event) -> Event:
    return dataclasses.replace(event, event_id="00000000-0000-0000-0000-000000000000")


def bad_topic(event: Event) -> Event:
    return dataclasses.replace(event, topic="")


def forge_header(event: Event) -> Event:
    """A transform fed by a hostile writer's payload may return whatever it was given."""
    return dataclasses.replace(event, headers={**event.headers, "event-id": "forged"})


def not_an_event(event: Event) -> object:
    return {"topic": event.topic}


def split(event: Event) -> Event:
    """Each key's events sent under two keys (odd and even ``n``), re-routed to ``<topic>.v2``."""
    n = json.loads(event.payload)["n"]
    assert event.key is not None
    return dataclasses.replace(
        event,
        topic=event.topic + ".v2",
        key=event.key + (b"-odd" if n % 2 else b"-even"),
        payload={"order": n},
    )


def headers_from_payload(event: Event) -> Event:
    """Copies headers out of the payload: what a writer puts there reaches the transform's
    return, so the relay must check it as it checks a writer's own headers."""
    return dataclasses.replace(event, headers={**event.headers, **json.loads(event.payload)["headers"]})


def fail_with_payload(event: Event) -> Event:
    """Fails with the writer's payload as its message: what an exception says is untrusted text."""
    raise ValueError(event.payload.decode("utf-8", "replace"))
