"""A lane of an outbox that no database backs, for the relay's unit tests: its ordering keyed
(holds and parks on), its membership a stand-in with an id."""

from __future__ import annotations

import uuid
from types import SimpleNamespace
from typing import Any, cast

from outbox.relay.lanes import Lane
from outbox.relay.ordering import Ordering
from outbox.store.outboxes import Outbox


def a_lane(name: str = "o", schema: str = "s") -> Lane:
    member = SimpleNamespace(id=uuid.uuid4(), link=None)
    ordering = Ordering(
        member=cast(Any, member), schema=schema, name="r", lease=30.0, batch_lease=30.0, ordering="key",
        on_dead="park",
    )  # fmt: skip
    return Lane(Outbox(name, "postgresql://unused", schema), ordering)
