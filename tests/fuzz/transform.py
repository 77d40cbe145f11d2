"""The fuzzer's transform (``--transform 'xf.*=tests.fuzz.transform:directed'``): it does what the
event's payload says, so that what a transform raises or returns is a door the fuzzer writes
through too. A transform is the operator's code; what it is fed is a writer's.

Payload ``{"raise": TEXT}``: raises ValueError(TEXT). ``{"return": {FIELD: VALUE, ...}}``: returns
the event with those fields (any JSON: the relay must check what comes back as enqueue checks a
writer's event). ``{"drop": true}``: None. Anything else: the event as it is.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from outbox import Event

FIELDS = ("topic", "key", "payload", "headers", "type", "subject", "event_id")


def directed(event: Event) -> Any:
    try:
        order = json.loads(event.payload)
    except ValueError:
        return event
    if not isinstance(order, dict):
        return event
    if "raise" in order:
        raise ValueError(str(order["raise"]))
    if order.get("drop"):
        return None
    changes = order.get("return")
    if isinstance(changes, dict):
        return dataclasses.replace(event, **{k: v for k, v in changes.items() if k in FIELDS})
    return event
