"""Standard Webhooks signing (https://www.standardwebhooks.com): secrets and signatures.

Apart from the webhook sink so that the CLI can check ``--webhook-secret`` without aiohttp.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Mapping, Sequence

from outbox.errors import ConfigError

SECRET_BYTES = (24, 64)  # the specification's bounds of a signing secret, in bytes


def parse_secrets(text: str | None, field: str = "--webhook-secret") -> list[bytes]:
    """``whsec_<base64>`` secrets, space-separated, as keys; ConfigError without echoing them."""
    keys: list[bytes] = []
    for i, item in enumerate((text or "").split(), 1):
        if not item.startswith("whsec_"):
            raise ConfigError(f"{field}: secret {i} does not start with 'whsec_'")
        try:
            keys.append(base64.b64decode(item[len("whsec_") :], validate=True))
        except ValueError:
            raise ConfigError(f"{field}: secret {i} is not whsec_ followed by base64") from None
        if not SECRET_BYTES[0] <= len(keys[-1]) <= SECRET_BYTES[1]:
            raise ConfigError(
                f"{field}: secret {i} is {len(keys[-1])} bytes; Standard Webhooks secrets are "
                f"{SECRET_BYTES[0]} to {SECRET_BYTES[1]} bytes (whsec_ and their base64)"
            )
    return keys


_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def parse_secret_envs(items: Sequence[str], environ: Mapping[str, str]) -> list[tuple[str, list[bytes]]]:
    """``--webhook-secret-env GLOB=VARIABLE`` values (each may hold several, whitespace-separated)
    as (topic glob, secrets), in order: the secrets are read from the variable, so they never
    stand on a command line. Errors name the option and the variable, never a secret."""
    out: list[tuple[str, list[bytes]]] = []
    for text in (t for item in items for t in item.split()):
        glob, sep, name = text.partition("=")
        if not sep or not glob or not _VARIABLE.fullmatch(name):
            raise ConfigError(
                f"--webhook-secret-env: expected GLOB=VARIABLE (a topic glob and the name of an "
                f"environment variable), got {glob or '(no glob)'}={'…' if name else ''}"
            )
        field = f"--webhook-secret-env {glob}={name}"
        value = environ.get(name)
        if not value or not value.strip():
            raise ConfigError(f"{field}: the variable {name} is not set")
        out.append((glob, parse_secrets(value, field)))
    return out


def signature(keys: list[bytes], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,<sig>`` per key, space-separated."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")
        for key in keys
    )
