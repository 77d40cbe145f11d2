"""``outbox console``: the operator console, served standalone (extra ``outbox-relay[console]``)."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
from dataclasses import dataclass
from typing import Any

from outbox.cli import options
from outbox.cli.common import add_common, connect_outbox, dsn_of, schema_of
from outbox.cli.outboxes import add_outboxes, choose, is_fleet
from outbox.errors import ConfigError
from outbox.extras import require
from outbox.settings import setting
from outbox.store.pooling import COMMANDS_NEED, require_own_sessions

log = logging.getLogger("outbox.console")

ENV_PREFIX = "OUTBOX_CONSOLE_"
PASSWORD_ENV = "OUTBOX_CONSOLE_PASSWORD"  # only from the environment: argv is visible to every user


@dataclass
class ConsoleOptions:
    host: str = setting("127.0.0.1", "address to listen on (without a password: loopback only)")
    port: int = setting(8000, "port to listen on")
    read_only: bool = setting(False, "show everything, change nothing (enforced on the server)")
    hide_payloads: bool = setting(False, "show payloads only after a click")
    trace_url: str | None = setting(
        None, "link each traceparent to your tracing UI, e.g. https://jaeger.example/trace/{trace_id}",
        metavar="TEMPLATE",
    )  # fmt: skip
    user: str = setting("outbox", f"HTTP basic user (with the password in {PASSWORD_ENV})")
    allowed_host: list[str] = setting(
        default_factory=list,
        help="a host name the console is reached by, besides localhost, 127.0.0.1 and ::1; "
        "repeatable (in the variable: separated by whitespace). Requests for any other name are "
        "refused: a page of another site whose name points here (DNS rebinding) gets nothing",
        metavar="NAME",
    )
    forwarded_allow_ips: list[str] = setting(
        default_factory=list,
        help="the address of a reverse proxy in front of the console, whose X-Forwarded-For and "
        "X-Forwarded-Proto are believed; repeatable (in the variable: separated by whitespace). "
        "By default no forwarding header is: from anyone else it would name the client (and the "
        "audit trail's actor) at will",
        metavar="ADDRESS",
    )


def register(sub: Any) -> None:
    p = sub.add_parser("console", help="the operator console in a browser (outbox-relay[console])")
    add_common(p)
    add_outboxes(p)
    options.add(p, ConsoleOptions, env_prefix=ENV_PREFIX)
    p.set_defaults(run=cmd_console)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def cmd_console(args: argparse.Namespace) -> int:
    require("console", "outbox console")
    import uvicorn

    from outbox.console.web import app, basic_auth

    password = os.environ.get(PASSWORD_ENV, "")
    if not password and not _loopback(args.host):
        raise ConfigError(
            f"--host {args.host}: without a password ({PASSWORD_ENV}) the console listens on loopback only"
        )
    if args.trace_url is not None and "{trace_id}" not in args.trace_url:
        raise ConfigError(f"--trace-url: must contain {{trace_id}}, got {args.trace_url!r}")
    level = "read" if args.read_only else "write"
    authorize = basic_auth(args.user, password, level=level) if password else None
    hosts = [name for item in args.allowed_host for name in item.split()]
    shared = {
        "read_only": args.read_only, "authorize": authorize, "hide_payloads": args.hide_payloads,
        "trace_url": args.trace_url, "allowed_hosts": hosts,
    }  # fmt: skip
    if is_fleet(args):
        from outbox.console.fleet import app as fleet

        chosen = choose(args)
        for what, why in chosen.skipped.items():
            log.warning("%s is not shown: %s", what, why)
        if not chosen.outboxes:
            raise ConfigError("--outbox/--schemas/--outboxes-file: no outbox to show")
        for dsn in dict.fromkeys(o.dsn for o in chosen.outboxes):
            require_own_sessions(dsn, "the console", COMMANDS_NEED)
        application = fleet(chosen.outboxes, **shared)
        shown = f"{len(chosen.outboxes)} outboxes"
    else:
        require_own_sessions(dsn_of(args), "the console", COMMANDS_NEED)
        connect_outbox(args).close()  # its schema and outbox_fleet trusted, or one line saying why
        application = app(dsn_of(args), schema=schema_of(args), **shared)
        shown = f"schema {schema_of(args)}"
    if not _loopback(args.host) and not hosts:
        log.warning(
            "listening on %s, but answering only to localhost, 127.0.0.1 and ::1: give the name "
            "(or address) users reach it by with --allowed-host",
            args.host,
        )
    if not password:
        log.warning(
            "no password (%s): anyone who can reach %s:%d can use the console; listening on loopback only",
            PASSWORD_ENV, args.host, args.port,
        )  # fmt: skip
    log.info(
        "console on http://%s:%d/ (%s%s)",
        args.host, args.port, shown, ", read-only" if args.read_only else "",
    )  # fmt: skip
    # uvicorn believes X-Forwarded-For from 127.0.0.1 by default: any local client could name
    # itself in the audit trail. Only a proxy the operator names is believed.
    proxies = [address for item in args.forwarded_allow_ips for address in item.split()]
    uvicorn.run(
        application, host=args.host, port=args.port, log_level="warning", access_log=False,
        proxy_headers=bool(proxies), forwarded_allow_ips=",".join(proxies) or None,
    )  # fmt: skip
    return 0
