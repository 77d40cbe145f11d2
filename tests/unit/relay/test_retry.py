"""outbox.retry: the persisted retry schedule (pure)."""

from __future__ import annotations

import random

import pytest

from outbox.errors import ConfigError
from outbox.relay.retry import MAX_ERROR_CHARS, RetryPolicy, cap_error


def test_backoff_grows_exponentially_within_jitter_and_cap() -> None:
    policy = RetryPolicy(base=1.0, cap=60.0, max_attempts=10)
    rng = random.Random(1)
    for attempt in range(1, 12):
        step = min(60.0, 2.0 ** (attempt - 1))
        for _ in range(50):
            d = policy.next_delay(attempt, rng)
            assert step / 2 <= d <= step
    assert policy.next_delay(1000, rng) <= 60.0


def test_exhaustion_and_validation() -> None:
    policy = RetryPolicy(max_attempts=3)
    assert not policy.exhausted(2)
    assert policy.exhausted(3)
    with pytest.raises(ConfigError, match="base"):
        RetryPolicy(base=0)
    with pytest.raises(ConfigError, match="cap"):
        RetryPolicy(base=10, cap=1)
    with pytest.raises(ConfigError, match="max attempts"):
        RetryPolicy(max_attempts=0)


def test_error_text_is_capped() -> None:
    assert cap_error("short") == "short"
    capped = cap_error("x" * 10_000)
    assert len(capped) == MAX_ERROR_CHARS and capped.endswith("(truncated)")
