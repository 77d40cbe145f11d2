"""Schema names: validation and the names derived from them.

The schema is the one identifier a user chooses. It only ever reaches SQL through
``psycopg.sql.Identifier`` (or ``Literal`` inside PL/pgSQL), so any name is safe;
validation exists to give a clear error for names PostgreSQL would reject or
silently truncate.
"""

from __future__ import annotations

from outbox.errors import ConfigError, InvalidType

DEFAULT_SCHEMA = "outbox"
FLEET_SCHEMA = "outbox_fleet"  # migration 0018: the database's relays and limits, shared by its outboxes

# PostgreSQL truncates identifiers at 63 bytes; the NOTIFY channel adds "_events".
MAX_SCHEMA_BYTES = 56


def validate_name(name: object, field: str, max_bytes: int) -> str:
    """Return ``name`` if PostgreSQL keeps it as given as an identifier, else raise naming ``field``."""
    if not isinstance(name, str):
        raise InvalidType(f"{field}: expected str, got {type(name).__name__}")
    if not name:
        raise ConfigError(f"{field}: must not be empty")
    if "\x00" in name:
        raise ConfigError(f"{field}: must not contain NUL characters")
    if not name.isprintable():
        # A line break would end a comment that names it (migrate --print) and run the rest.
        raise ConfigError(f"{field}: must be printable text (no line breaks or control characters)")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise ConfigError(f"{field}: is not valid Unicode text (lone surrogate)") from None
    if size > max_bytes:
        raise ConfigError(f"{field}: {size} bytes long, at most {max_bytes} allowed")
    if "%" in name:
        # psycopg reads % in a query that has parameters as a placeholder, inside
        # quoted identifiers too.
        raise ConfigError(f"{field}: must not contain %, got {name!r}")
    if "$$" in name:
        # It would end the dollar-quoted bodies (functions, DO blocks) it appears in.
        raise ConfigError(f"{field}: must not contain $$, got {name!r}")
    if name.lower().startswith("pg_"):
        raise ConfigError(f"{field}: {name!r} is reserved by PostgreSQL (names starting with pg_ are)")
    return name


def validate_schema(schema: object, field: str = "schema") -> str:
    """Return ``schema`` if it is a usable schema name, else raise naming ``field``."""
    return validate_name(schema, field, MAX_SCHEMA_BYTES)


def channel_name(schema: str) -> str:
    """The LISTEN/NOTIFY channel on which inserts into ``schema.events`` are announced."""
    return f"{schema}_events"


def schema_or_default(schema: str | None) -> str:
    """``schema`` validated, or the default schema when None (the writer's and the inbox's ``schema=``)."""
    return DEFAULT_SCHEMA if schema is None else validate_schema(schema)
