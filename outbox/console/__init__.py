"""The operator console (``outbox console``, extra ``outbox-relay[console]``): every queue, key and
dead letter of an outbox in a browser, and the actions that fix them, audited like the CLI's.

``outbox.console.app(dsn, ...)`` returns the ASGI application, to run or to mount;
``outbox.console.app(outboxes=[Outbox(name, dsn, schema), ...])`` the console over several: a fleet
page, and each outbox's pages under its name.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from outbox.extras import require

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from outbox.store.outboxes import Outbox

__all__ = ["app"]


def app(dsn: str | None = None, *, outboxes: Sequence[Outbox] | None = None, **options: Any) -> Starlette:
    """The console as an ASGI application: of the outbox in ``dsn`` (and ``schema=``), or over
    ``outboxes`` (see :func:`outbox.console.web.app` and :func:`outbox.console.fleet.app` for the
    options)."""
    require("console", "outbox console")
    if outboxes is not None:
        if dsn is not None or "schema" in options:
            raise TypeError("app(): give dsn (and schema) or outboxes, not both")
        from outbox.console.fleet import app as fleet

        return fleet(outboxes, **options)
    if dsn is None:
        raise TypeError("app(): give dsn (and schema), or outboxes")
    from outbox.console.web import app as make

    return make(dsn, **options)
