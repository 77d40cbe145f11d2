"""A relay's readiness as one structured value.

:class:`Readiness` is what ``/readyz`` answers, what the heartbeats record (its ``label``: shown
by ``outbox status`` and the console), and what the ``outbox_not_ready`` metric counts (its
``reason``): built once, never parsed back from its text.
"""

from __future__ import annotations

from dataclasses import dataclass

OUTBOXES_NOT_SERVED = "outboxes not served"  # /readyz: the relay is fine, some of its outboxes are not
# The metric's reason of each label: database, sink, stalled, or lifecycle (the rest).
_REASONS = {
    "database unreachable": "database",
    "sink unhealthy": "sink",
    "sink down": "sink",
    "stalled": "stalled",
}


@dataclass(frozen=True)
class Readiness:
    """``label``: the kind (ready, starting, draining: shutting down, sink unhealthy, sink down,
    database unreachable, stalled, outboxes not served); ``detail`` what follows it on the first
    line; ``sinks`` one line per sink; ``outboxes`` one line per outbox worth a line."""

    label: str
    detail: str = ""
    sinks: tuple[str, ...] = ()
    outboxes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.label == "ready"

    @property
    def reason(self) -> str:
        """The ``outbox_not_ready`` metric's label: database, sink, stalled or lifecycle."""
        return _REASONS.get(self.label, "lifecycle")

    @property
    def head(self) -> str:
        return f"{self.label}: {self.detail}" if self.detail else self.label

    def text(self) -> str:
        """/readyz's body: the head, then the sinks' lines, then the outboxes'."""
        return "\n".join([self.head, *self.sinks, *self.outboxes])
