"""Named SQL, loaded once from ``outbox/sql/queries.sql``.

Runtime code never assembles SQL by hand: it asks for a query by name and gets
a :class:`psycopg.sql.Composed` with the schema bound as an identifier. Values
are always passed as parameters.
"""

from __future__ import annotations

import functools
import importlib.resources
import re

from psycopg import sql

from outbox.schema import channel_name, validate_schema

_BLOCK = re.compile(r"^-- name: (\w+)\n", re.MULTILINE)


@functools.cache
def _raw_queries() -> dict[str, str]:
    queries: dict[str, str] = {}
    for entry in sorted(importlib.resources.files("outbox").joinpath("sql").iterdir(), key=str):
        if not entry.name.endswith(".sql"):
            continue
        parts = _BLOCK.split(entry.read_text("utf-8"))
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise RuntimeError(f"query {name!r} is defined twice in outbox/sql/")
            lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
            queries[name] = "\n".join(lines).strip()
    return queries


def names() -> list[str]:
    """Every query name in the file (used by tests)."""
    return sorted(_raw_queries())


def query(name: str, schema: str, **keywords: str) -> sql.Composed:
    """The named query with ``{schema}`` bound to ``schema`` as an identifier.

    ``keywords`` fill other placeholders with fixed SQL keywords chosen by our
    own code (e.g. ``state="ENABLE"``), never with user input.
    """
    return _query(name, schema, tuple(sorted(keywords.items())))


@functools.lru_cache(maxsize=256)
def _query(name: str, schema: str, keywords: tuple[tuple[str, str], ...]) -> sql.Composed:
    validate_schema(schema)
    try:
        raw = _raw_queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in outbox/sql/") from None
    return sql.SQL(raw).format(
        schema=sql.Identifier(schema),
        schema_name=sql.Literal(schema),
        channel=sql.Literal(channel_name(schema)),
        **{k: sql.SQL(v) for k, v in keywords},
    )
