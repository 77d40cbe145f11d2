"""The per-event retry schedule: a pure function, persisted on the row by the relay.

The schedule lives in the database (``attempts``, ``available_at``,
``last_error``) so that it survives restarts and is shared by every relay
process. tenacity is used elsewhere, only for in-process transient failures
(reconnecting to PostgreSQL).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from outbox.errors import ConfigError
from outbox.escape import escape
from outbox.settings import setting

MAX_ERROR_CHARS = 2000  # characters of last_error kept on the row


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with jitter, capped; ``max_attempts`` failures -> dead letter."""

    base: float = setting(1.0, "seconds before the first retry", flag="--retry-base", env="OUTBOX_RETRY_BASE")
    cap: float = setting(
        300.0, "longest wait between retries, seconds", flag="--retry-cap", env="OUTBOX_RETRY_CAP"
    )
    max_attempts: int = setting(10, "attempts in all (the first included) before dead-lettering")

    def __post_init__(self) -> None:
        if not self.base > 0:
            raise ConfigError(f"retry base: must be > 0 seconds, got {self.base}")
        if not self.cap >= self.base:
            raise ConfigError(f"retry cap: must be >= base ({self.base}), got {self.cap}")
        if self.max_attempts < 1:
            raise ConfigError(f"max attempts: must be >= 1, got {self.max_attempts}")

    def exhausted(self, attempts_made: int) -> bool:
        """True when ``attempts_made`` failed attempts leave none to try."""
        return attempts_made >= self.max_attempts

    def next_delay(self, attempts_made: int, rng: random.Random | None = None) -> float:
        """Seconds to wait after the ``attempts_made``-th failed attempt (1-based).

        "Equal jitter": half the exponential step is fixed, half random, so
        retries of a burst spread out but never come back sooner than half the
        schedule.
        """
        if attempts_made < 1:
            raise ValueError(f"attempts_made: must be >= 1, got {attempts_made}")
        step = min(self.cap, self.base * 2.0 ** min(attempts_made - 1, 62))
        r = (rng or random).random()
        return step / 2 + r * step / 2


def cap_error(reason: str) -> str:
    """The error text as stored on the row: escaped (a sink's reply or a writer's field may hold
    control characters, a NUL PostgreSQL refuses in text, or a line break that would forge a line
    wherever it is shown) and capped, so a huge message cannot bloat the table."""
    reason = escape(reason)
    if len(reason) <= MAX_ERROR_CHARS:
        return reason
    suffix = "… (truncated)"
    return reason[: MAX_ERROR_CHARS - len(suffix)] + suffix
