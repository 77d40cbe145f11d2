"""A migration that waits for a table's lock without stopping the writers.

``ALTER TABLE`` takes an ACCESS EXCLUSIVE lock. While it waits for one (behind a relay's batch,
whose row locks are held until its sink answers, or a long report), every writer's INSERT into
that table queues behind the waiting ALTER: the application stops for as long as the oldest
transaction lasts. So each migration's transaction sets ``lock_timeout``: it waits at most that
long, lets go (the writers go on), waits a little, and tries again, until ``wait`` has passed.
Then it fails in one line naming the transactions that hold locks on the schema's tables.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import psycopg

from outbox.errors import OutboxError
from outbox.store.queries import query

LOCK_TIMEOUT = 2.0  # seconds one try waits for a lock: writers queue behind it at most this long
LOCK_WAIT = 600.0  # seconds in all before migrate gives up
PAUSE_MAX = 10.0  # seconds between tries, at most
SHOWN = 3  # the lock holders a failure names

T = TypeVar("T")


class LockWaitExpired(OutboxError):
    """A migration did not get its lock within ``--lock-wait``; nothing of it was applied."""

    exit_code = 1


@dataclass(frozen=True)
class LockWait:
    """How a migration waits for its locks: ``timeout`` seconds a try (0: wait as long as it
    takes, the writers behind it), ``wait`` seconds in all; ``waiting`` is told of each retry
    (what, tries so far, seconds waited, seconds until the next), ``got`` of a lock got after
    retries (what, tries, seconds waited)."""

    timeout: float = LOCK_TIMEOUT
    wait: float = LOCK_WAIT
    waiting: Callable[[str, int, float, float], None] | None = None
    got: Callable[[str, int, float], None] | None = None

    def __post_init__(self) -> None:
        if self.timeout < 0:
            raise ValueError(f"--lock-timeout: must be >= 0, got {self.timeout:g}")
        if self.wait < 0:
            raise ValueError(f"--lock-wait: must be >= 0, got {self.wait:g}")

    def pause(self, tries: int) -> float:
        """Seconds before try ``tries + 1``: growing, jittered, at most PAUSE_MAX."""
        return min(PAUSE_MAX, 0.5 * 2.0 ** min(tries, 8)) * random.uniform(0.5, 1.0)


def retrying(
    conn: psycopg.Connection[Any], schema: str, what: str, policy: LockWait, step: Callable[[], T]
) -> T:
    """``step``'s result: it runs again when it ran out of its lock timeout (its transaction
    rolled back: it applied nothing), after a pause, until ``policy.wait`` has passed; then
    :class:`LockWaitExpired` names ``what`` and the transactions holding locks in ``schema``."""
    started = time.monotonic()
    tries = 0
    while True:
        try:
            result = step()
        except psycopg.errors.LockNotAvailable:
            tries += 1
            waited = time.monotonic() - started
            left = policy.wait - waited
            if left <= 0:
                raise LockWaitExpired(_expired(conn, schema, what, tries, policy)) from None
            pause = min(policy.pause(tries), left)
            if policy.waiting is not None:
                policy.waiting(what, tries, waited, pause)
            time.sleep(pause)
            continue
        if tries and policy.got is not None:
            policy.got(what, tries, time.monotonic() - started)
        return result


@contextmanager
def limited(conn: psycopg.Connection[Any], policy: LockWait) -> Iterator[None]:
    """The statements of the block wait at most ``policy.timeout`` for each lock. Set for the
    transaction only, and set back after it (inside a caller's transaction, its own setting
    holds again for what follows)."""
    if not policy.timeout:
        yield
        return
    timeout = f"{max(1, round(policy.timeout * 1000))}ms"
    before = conn.execute(query("lock_timeout_set", "public"), {"timeout": timeout}).fetchone()
    yield
    conn.execute(query("lock_timeout_set", "public"), {"timeout": before[0] if before else "0"})


def _expired(conn: psycopg.Connection[Any], schema: str, what: str, tries: int, policy: LockWait) -> str:
    """The failure's line: what waited, how long, and on whom (the transactions holding locks on
    the schema's tables)."""
    try:
        with conn.transaction():  # a savepoint inside a caller's transaction: it goes on as it was
            found = conn.execute(query("lock_holders", "public"), {"schema": schema, "limit": SHOWN})
            rows = found.fetchall()
    except psycopg.Error:
        rows = []
    held = "; ".join(_transaction(*row) for row in rows) or "none left"
    return (
        f"{what}: its lock was not free within --lock-wait {policy.wait:g} s ({tries} tries of "
        f"{policy.timeout:g} s; nothing of it applied, and writers waited at most that long a try). "
        f"Holding locks on schema {schema}'s tables: {held}. End them, or migrate when they are done"
    )


def _transaction(pid: int, application: str | None, state: str | None, age: float | None) -> str:
    """A transaction as a failure names it; the application's name is another role's text: only
    its printable characters, shortened."""
    name = "".join(ch if ch.isprintable() else "?" for ch in (application or ""))[:40]
    parts = [f"pid {pid}"] + ([name] if name else []) + ([state] if state else [])
    return ", ".join(parts) + (f" ({age:.0f} s)" if age is not None else "")
