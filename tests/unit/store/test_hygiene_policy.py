"""outbox.hygiene: when the relay vacuums its own hot table (pure)."""

from __future__ import annotations

import threading

from outbox.store.hygiene import Hygiene


def test_hygiene_vacuums_when_dead_tuples_dominate_not_mid_drain() -> None:
    h = Hygiene("", "outbox", threading.Event(), threshold=20_000)
    assert h.needs_vacuum(dead=25_000, live=300, size=10 << 20)  # steady state: bloat
    assert not h.needs_vacuum(dead=25_000, live=400_000, size=100 << 20)  # big backlog draining
    assert not h.needs_vacuum(dead=5_000, live=3_000, size=2 << 20)  # below the threshold, not drained
    assert h.needs_vacuum(dead=5_000, live=0, size=2 << 20)  # drained but large: truncate
    assert not h.needs_vacuum(dead=5_000, live=0, size=100_000)  # drained and small
    assert h.needs_vacuum(dead=19_000, live=12, size=4 << 20)  # drained, stats drifted a little
    # Before PostgreSQL 15 the live estimate can stay in the thousands in an empty table (the
    # matrix: 2,000 "live", 1,400 dead, a 9.4 MiB heap): under one live tuple per 2 KiB of heap
    # the table is mostly empty space, and is vacuumed.
    assert h.needs_vacuum(dead=1_400, live=2_000, size=9_830_400)
    assert not h.needs_vacuum(dead=1_400, live=6_000, size=9_830_400)  # a backlog still in it


def test_a_large_empty_table_is_vacuumed_whatever_its_dead_count_says() -> None:
    """The matrix on PostgreSQL 13: 0 dead and 3,800 "live" in an empty 9.4 MiB table (a vacuum
    during the drain zeroed the dead count; the last deletes stayed unreported in an idle
    session). The relay never vacuumed it while it asked for dead tuples first."""
    h = Hygiene("", "outbox", threading.Event(), threshold=5_000)
    assert h.needs_vacuum(dead=0, live=3_800, size=9_830_400)
    assert h.needs_vacuum(dead=0, live=0, size=9_830_400)  # after a statistics reset
    assert not h.needs_vacuum(dead=0, live=0, size=500_000)  # small: nothing to truncate
    assert not h.needs_vacuum(dead=0, live=30_000, size=9_830_400)  # a backlog, not empty space
