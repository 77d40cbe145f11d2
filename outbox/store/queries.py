"""Named SQL, loaded once from the ``.sql`` files in ``outbox/store/sql/``.

Runtime code never assembles SQL by hand: it asks for a statement by name and
gets a :class:`psycopg.sql.Composed` with the schema bound as an identifier.
Values are parameters; the few statements that cannot take parameters (DDL,
``migrate --print`` output) get identifiers and literals bound through
``psycopg.sql``, never through string formatting.

One file per concept (``relay.sql``, ``ordering.sql``, ``dead.sql`` …); a name
is unique across all of them, and the loader refuses a duplicate.
"""

from __future__ import annotations

import functools
import importlib.resources
import re
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import TYPE_CHECKING

from psycopg import sql
from psycopg.abc import AdaptContext

from outbox.store.schema import channel_name, validate_schema

if TYPE_CHECKING:
    from importlib.abc import Traversable

_BLOCK = re.compile(r"^-- name: (\w+)\n", re.MULTILINE)

# Statements that run on a session the project does not pin (outbox.pinning): the application's
# (the writers, the inbox), or a consumer's claim-check fetch. Its search_path is its owner's, and
# another role may have planted overloads there: these name every function in pg_catalog (an
# unqualified unnest(uuid[]) would call a planted one even with exact types, beating
# unnest(anyarray)) and give every operator pg_catalog's exact argument types.
# tests/unit/store/test_queries.py checks the names; tests/acceptance/test_search_path_traps.py runs them.
APPLICATION_SESSION = frozenset(
    {
        *("insert_event", "insert_events_arrays", "copy_events", "copy_events_text", "first_statement"),
        *("insert_event_numbered", "insert_events_arrays_numbered", "events_table", "events_table_numbered"),
        *("writer_capture", "writer_capture_numbered", "capture_mode"),
        *("emit_events", "emit_events_binary", "emit_events_numbered"),
        *("inbox_record", "inbox_record_numbered", "inbox_table", "inbox_table_numbered"),
        *("inbox_prune", "inbox_count_before"),
        *("claim_check_put", "claim_check_get", "claim_check_purge_chunk", "claim_check_held"),
        "claim_check_table",
    }
)


def read_named(folder: Traversable, where: str) -> dict[str, str]:
    """Every ``-- name: NAME`` block of the ``.sql`` files in ``folder``, comment lines dropped;
    a name defined twice is refused (``where`` names the folder). Another distribution built on
    this one (the bench) loads its own statements so."""
    queries: dict[str, str] = {}
    for entry in sorted(folder.iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        parts = _BLOCK.split(entry.read_text("utf-8"))
        # parts = [preamble, name1, body1, name2, body2, ...]
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in queries:
                raise RuntimeError(f"query {name!r} is defined twice in {where}")
            lines = [line for line in body.strip().splitlines() if not line.startswith("--")]
            queries[name] = "\n".join(lines).strip()
    return queries


@functools.cache
def _raw_queries() -> dict[str, str]:
    return read_named(importlib.resources.files("outbox.store").joinpath("sql"), "outbox/store/sql/")


def names() -> list[str]:
    """Every query name (used by tests)."""
    return sorted(_raw_queries())


def raw(name: str) -> str:
    """The text of a named statement, placeholders unbound."""
    try:
        return _raw_queries()[name]
    except KeyError:
        raise KeyError(f"no query named {name!r} in outbox/store/sql/") from None


def query(
    name: str,
    schema: str,
    *,
    keywords: Mapping[str, str] | None = None,
    identifiers: Mapping[str, str] | None = None,
    literals: Mapping[str, Hashable] | None = None,
    fragments: Mapping[str, str | None] | None = None,
) -> Statement:
    """The named statement with ``{schema}`` bound to ``schema`` as an identifier.

    ``keywords`` fill placeholders with fixed SQL words chosen by our own code
    (``state="ENABLE"``), never with user input; ``identifiers`` with names
    quoted as identifiers (inside ``schema``); ``literals`` with quoted values.
    ``fragments`` fill placeholders with another named block's text (None: nothing), before the
    rest is bound: a clause that only some executions need stays out of the others' plans.
    """
    return compose(raw, name, schema, keywords=keywords, identifiers=identifiers, literals=literals,
                   fragments=fragments)  # fmt: skip


def compose(
    source: Callable[[str], str],
    name: str,
    schema: str,
    *,
    keywords: Mapping[str, str] | None = None,
    identifiers: Mapping[str, str] | None = None,
    literals: Mapping[str, Hashable] | None = None,
    fragments: Mapping[str, str | None] | None = None,
) -> Statement:
    """:func:`query` of a statement that ``source`` gives by name: another distribution's own
    (a module-level function, so that the composed statements are cached)."""
    return _query(
        source, name, schema, _items(keywords), _items(identifiers), _items(literals), _items(fragments)
    )


def _items(mapping: Mapping[str, Hashable] | None) -> tuple[tuple[str, Hashable], ...]:
    return tuple(sorted(mapping.items())) if mapping else ()


class Statement(sql.Composed):
    """A named statement that keeps its bytes once rendered for a connection's encoding and string
    quoting: psycopg renders a ``Composed`` again at every execute (every identifier and literal
    quoted by libpq), on the relay's claim a cost per batch (decision 0013)."""

    def __init__(self, composed: sql.Composed) -> None:
        super().__init__(list(composed))
        self._rendered: dict[tuple[str, bytes | None], bytes] = {}

    def as_bytes(self, context: AdaptContext | None = None) -> bytes:
        conn = context.connection if context is not None else None
        pgconn = conn.pgconn if conn is not None else None
        how = (
            (pgconn._encoding, pgconn.parameter_status(b"standard_conforming_strings"))
            if pgconn is not None
            else ("utf-8", None)
        )
        done = self._rendered.get(how)
        if done is None:
            done = self._rendered[how] = super().as_bytes(context)
        return done


@functools.lru_cache(maxsize=512)
def _query(
    source: Callable[[str], str],
    name: str,
    schema: str,
    keywords: tuple[tuple[str, Hashable], ...],
    identifiers: tuple[tuple[str, Hashable], ...],
    literals: tuple[tuple[str, Hashable], ...],
    fragments: tuple[tuple[str, Hashable], ...],
) -> Statement:
    validate_schema(schema)
    text = source(name)
    for placeholder, block in fragments:
        text = text.replace("{" + placeholder + "}", source(str(block)) if block else "")
    parts: dict[str, sql.Composable] = {
        "schema": sql.Identifier(schema),
        "schema_name": sql.Literal(schema),
        "channel": sql.Literal(channel_name(schema)),
    }
    parts.update((k, sql.SQL(str(v))) for k, v in keywords)
    parts.update((k, sql.Identifier(str(v))) for k, v in identifiers)
    parts.update((k, sql.Literal(v)) for k, v in literals)
    return Statement(sql.SQL(text).format(**parts))


def int_array(values: Iterable[int | None]) -> str:
    """A PostgreSQL array literal of integers, e.g. ``{1,2,NULL}``.

    Sent as one text parameter and cast in SQL (``%(ids)s::text::bigint[]``):
    psycopg would otherwise dump a list element by element in Python, a
    measurable cost per acknowledged event.
    """
    if not isinstance(values, list):
        values = list(values)
    if None not in values:  # the common case: map(str) runs in C, a generator per element does not
        return "{" + ",".join(map(str, values)) + "}"
    return "{" + ",".join("NULL" if v is None else str(v) for v in values) + "}"


def glob_regex(glob: str) -> str:
    """A PostgreSQL regular expression matching what ``fnmatchcase(topic, glob)`` matches."""
    out = []
    i = 0
    while i < len(glob):
        c = glob[i]
        if c == "*":
            out.append(".*")
        elif c == "?":
            out.append(".")
        elif c == "[" and (end := glob.find("]", i + 2 if glob[i + 1 : i + 2] in ("!", "]") else i + 1)) > 0:
            body = glob[i + 1 : end]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = end
        else:
            out.append(re.escape(c) if not c.isalnum() else c)
        i += 1
    return "^(?:" + "".join(out) + ")$"
