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
    text = importlib.resources.files("outbox").joinpath("sql/queries.sql").read_text("utf-8")
    parts = _BLOCK.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    queries: dict[str, str] = {}
    for name, body in zip(parts[1::2], parts[2::2], strict=False):
        lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
        queries[name] = "\n".join(lines).strip()
    return queries


def names() -> list[str]:
    """Every query name in the file (used by tests)."""
    return sorted(_raw_queries())


@functools.lru_cache(maxsize=256)
def query(name: str, schema: str) -> sql.Composed:
    """The named query with ``{schema}`` bound to ``schema`` as an identifier."""
    validate_schema(schema)
    try:
        raw = _raw_queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in outbox/sql/queries.sql") from None
    return sql.SQL(raw).format(
        schema=sql.Identifier(schema),
        schema_name=sql.Literal(schema),
        channel=sql.Literal(channel_name(schema)),
    )
