"""The seeds CI plays (``tests/integration/test_explore.py``), and every seed that ever found a
bug, kept as a regression case with what it found."""

from __future__ import annotations

# seed -> what it found, and where the fix is.
REGRESSIONS: dict[int, str] = {
    1: "a sink failing one send in four: 'deliveries failing' started and ended with every batch, "
    "a line pair per batch (conditions.Condition's settle)",
}

# Played by CI besides: a spread of relay counts, faults, capture modes and sink behaviours.
CI_SEEDS: tuple[int, ...] = (3, 4, 5)

# Seeds on which the explorer finds the ordering bug of KeyHolds.skip_after when it is put back
# (tests/explore_mutants.py): the proof that it finds bugs of that kind.
MUTANT_SEEDS: tuple[int, ...] = ()
