"""DSN helpers: secrets never leave this module in clear text."""

from __future__ import annotations

import re

from psycopg.conninfo import conninfo_to_dict, make_conninfo

_URL_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
# (password= also matches sslpassword=, in a key=value string and in a URL's query.)
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
# libpq's settings that hold a secret: the password, and the passphrase of the client's TLS key.
SECRET_PARAMS = ("password", "sslpassword")


def redact(dsn: str) -> str:
    """``dsn`` with every secret (:data:`SECRET_PARAMS`) replaced by ``***`` (works on URLs and
    key=value strings)."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # unparsable: mask by pattern, never echo as is
        return _KV_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", dsn))
    for name in SECRET_PARAMS:
        if name in params:
            params[name] = "***"
    return make_conninfo("", **params)


def scrub(text: str, secrets: list[str]) -> str:
    """``text`` with every non-empty secret replaced by ``***``."""
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def error_line(exc: BaseException, dsn: str) -> str:
    """A driver's error as one line (libpq's messages span several), without ``dsn``'s password."""
    return " ".join(scrub(str(exc), secrets_of(dsn)).split())


def secrets_of(dsn: str) -> list[str]:
    """The secret values inside a DSN (its password, its TLS key's passphrase), for scrubbing."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        return []
    return [str(params[name]) for name in SECRET_PARAMS if params.get(name)]


def secrets_in_argv(argv: list[str]) -> list[str]:
    """Secret values among command-line arguments: DSN passwords, and the values of
    ``KEY=VALUE`` settings whose key names a secret (``sasl.password=...``)."""
    found: list[str] = []
    for arg in argv:
        if "=" in arg or "://" in arg:
            found.extend(secrets_of(arg))
        key, sep, value = arg.partition("=")
        if sep and value and any(word in key.lower() for word in ("password", "secret", "pem", "token")):
            found.append(value)
    return found


# libpq settings that make a dead peer (a blackhole, a half-open connection) an error within
# seconds instead of the kernel's two hours: keepalive probes on idle connections, and
# tcp_user_timeout on data (or probes) left unacknowledged. A DSN that sets one keeps its own.
KEEPALIVE_IDLE = 5  # seconds of silence before the first probe
KEEPALIVE_INTERVAL = 2  # seconds between probes


def with_net_timeouts(dsn: str, timeout: float) -> str:
    """``dsn`` plus connect_timeout, keepalives and tcp_user_timeout for a dead peer to be
    noticed within about ``timeout`` seconds; settings the DSN already has are left alone."""
    given = conninfo_to_dict(dsn)
    wanted: dict[str, str] = {
        "connect_timeout": str(max(2, round(timeout))),
        "keepalives": "1",
        "keepalives_idle": str(KEEPALIVE_IDLE),
        "keepalives_interval": str(KEEPALIVE_INTERVAL),
        "keepalives_count": str(max(1, round((timeout - KEEPALIVE_IDLE) / KEEPALIVE_INTERVAL))),
        "tcp_user_timeout": str(int(timeout * 1000)),
    }
    missing = {k: v for k, v in wanted.items() if k not in given}
    return make_conninfo(dsn, **missing) if missing else dsn


def for_child(dsn: str) -> tuple[str, dict[str, str]]:
    """``dsn`` without its password, and the environment that gives it (``PGPASSWORD``), for a
    process this one starts: a command line is readable by every local user (``ps``), its
    environment only by the user that runs it."""
    try:
        params = conninfo_to_dict(dsn)
    except Exception:
        return dsn, {}
    password = params.pop("password", None)
    if not password:
        return dsn, {}
    return make_conninfo("", **params), {"PGPASSWORD": str(password)}
