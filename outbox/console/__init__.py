"""The operator console (``outbox console``, extra ``outbox[console]``): every queue, key and
dead letter of an outbox in a browser, and the actions that fix them, audited like the CLI's.

``outbox.console.app(dsn, ...)`` returns the ASGI application, to run or to mount.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from outbox.extras import require

if TYPE_CHECKING:
    from starlette.applications import Starlette

__all__ = ["app"]


def app(dsn: str, **options: Any) -> Starlette:
    """The console as an ASGI application (see :func:`outbox.console.web.app` for the options)."""
    require("console", "outbox console")
    from outbox.console.web import app as make

    return make(dsn, **options)
