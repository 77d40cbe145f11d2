"""What the relay's loop does besides claiming: small services, each with ``due(now)``, run at
every step before the step's claims, and ``next_at()``, its next deadline.

- :class:`~outbox.relay.upkeep.capture.CaptureWatch`: each outbox's capture mode, looked at before
  its first claim and then periodically; its WAL reader started and stopped.
- :class:`~outbox.relay.upkeep.partitions.ArchivePartitions`: the archive's day partitions.
- :class:`~outbox.relay.upkeep.sinks.SinkUpkeep`: sinks replaced, chained, probed, and the failures
  of an outage made due at once when they answer again.

Each gets what it uses in its constructor; their statements run through
:class:`~outbox.relay.upkeep.chores.Chores` on the relay's pool."""

from __future__ import annotations

from outbox.relay.upkeep.capture import CaptureWatch
from outbox.relay.upkeep.chores import Chores
from outbox.relay.upkeep.partitions import ArchivePartitions
from outbox.relay.upkeep.sinks import SinkUpkeep

__all__ = ["ArchivePartitions", "CaptureWatch", "Chores", "LaneUpkeep", "SinkUpkeep"]


class LaneUpkeep:
    """The services, in the order a step runs them: the capture's first looks before anything
    (a table is not claimed before), the partitions, the outage's retries."""

    def __init__(self, capture: CaptureWatch, partitions: ArchivePartitions, sinks: SinkUpkeep) -> None:
        self.capture = capture
        self.partitions = partitions
        self.sinks = sinks

    def due(self, now: float) -> None:
        self.capture.due(now)
        self.partitions.due(now)
        self.sinks.due(now)

    def next_at(self) -> float:
        """The deadline an idle loop wakes for: the partitions' check. The capture's periodic
        looks and the outage's retries ride on the steps the loop takes anyway (at 1,000 outboxes
        a look is due every 0.2 s, which an idle relay need not wake for)."""
        return self.partitions.next_at()
