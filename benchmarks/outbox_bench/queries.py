"""The bench's named SQL: the ``.sql`` files in ``outbox_bench/sql/`` (the baselines' claims, the
explorer's looks, the fault suite's counts), loaded as the runtime loads its own
(:mod:`outbox.store.queries`). A name the bench does not define is the runtime's: the bench runs
the relay's own statements too. A name defined by both is refused."""

from __future__ import annotations

import functools
import importlib.resources
from collections.abc import Hashable, Mapping

from outbox.store import queries as runtime
from outbox.store.queries import Statement


@functools.cache
def _own() -> dict[str, str]:
    own = runtime.read_named(importlib.resources.files("outbox_bench").joinpath("sql"), "outbox_bench/sql/")
    both = sorted(set(own) & set(runtime.names()))
    if both:
        raise RuntimeError(f"queries defined by both outbox_bench/sql/ and outbox/store/sql/: {both}")
    return own


def names() -> list[str]:
    """The bench's own query names (used by tests)."""
    return sorted(_own())


def raw(name: str) -> str:
    """The text of a named statement, the bench's or else the runtime's."""
    own = _own().get(name)
    return own if own is not None else runtime.raw(name)


def query(
    name: str,
    schema: str,
    *,
    keywords: Mapping[str, str] | None = None,
    identifiers: Mapping[str, str] | None = None,
    literals: Mapping[str, Hashable] | None = None,
    fragments: Mapping[str, str | None] | None = None,
) -> Statement:
    """:func:`outbox.store.queries.query`, for the bench's statements and the runtime's."""
    return runtime.compose(
        raw, name, schema, keywords=keywords, identifiers=identifiers, literals=literals, fragments=fragments
    )
