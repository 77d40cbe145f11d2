"""Schema names: validation and the names derived from them.

The schema is the one identifier a user chooses. It only ever reaches SQL through
``psycopg.sql.Identifier`` (or ``Literal`` inside PL/pgSQL), so any name is safe;
validation exists to give a clear error for names PostgreSQL would reject or
silently truncate.
"""

from __future__ import annotations

DEFAULT_SCHEMA = "outbox"

# PostgreSQL truncates identifiers at 63 bytes; the NOTIFY channel adds "_events".
MAX_SCHEMA_BYTES = 56


def validate_name(name: object, field: str, max_bytes: int) -> str:
    """Return ``name`` if PostgreSQL keeps it as given as an identifier, else raise naming ``field``."""
    if not isinstance(name, str):
        raise TypeError(f"{field}: expected str, got {type(name).__name__}")
    if not name:
        raise ValueError(f"{field}: must not be empty")
    if "\x00" in name:
        raise ValueError(f"{field}: must not contain NUL characters")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{field}: is not valid Unicode text (lone surrogate)") from None
    if size > max_bytes:
        raise ValueError(f"{field}: {size} bytes long, at most {max_bytes} allowed")
    return name


def validate_schema(schema: object, field: str = "schema") -> str:
    """Return ``schema`` if it is a usable schema name, else raise naming ``field``."""
    schema = validate_name(schema, field, MAX_SCHEMA_BYTES)
    if "%" in schema:
        # psycopg reads % in a query that has parameters as a placeholder, inside
        # quoted identifiers too.
        raise ValueError(f"{field}: must not contain %, got {schema!r}")
    if "$$" in schema:
        # It would end the dollar-quoted function bodies the migrations create.
        raise ValueError(f"{field}: must not contain $$, got {schema!r}")
    if schema.lower().startswith("pg_"):
        raise ValueError(f"{field}: names starting with pg_ are reserved by PostgreSQL, got {schema!r}")
    return schema


def channel_name(schema: str) -> str:
    """The LISTEN/NOTIFY channel on which inserts into ``schema.events`` are announced."""
    return f"{schema}_events"
