"""Standard Webhooks signing (https://www.standardwebhooks.com): secrets and signatures.

Apart from the webhook sink so that the CLI can check ``--webhook-secret`` without aiohttp.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from outbox.errors import ConfigError


def parse_secrets(text: str | None) -> list[bytes]:
    """``whsec_<base64>`` secrets, space-separated, as keys; ConfigError without echoing them."""
    keys: list[bytes] = []
    for i, item in enumerate((text or "").split(), 1):
        if not item.startswith("whsec_"):
            raise ConfigError(f"--webhook-secret: secret {i} does not start with 'whsec_'")
        try:
            keys.append(base64.b64decode(item[len("whsec_") :], validate=True))
        except ValueError:
            raise ConfigError(f"--webhook-secret: secret {i} is not whsec_ followed by base64") from None
        if not keys[-1]:
            raise ConfigError(f"--webhook-secret: secret {i} is empty")
    return keys


def signature(keys: list[bytes], msg_id: str, timestamp: int, body: bytes) -> str:
    """The ``webhook-signature`` value: ``v1,<sig>`` per key, space-separated."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return " ".join(
        "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode("ascii")
        for key in keys
    )
