"""Whether a DSN gives the relay sessions of its own, or a pooler's transactions.

The relay needs a server session per connection for as long as it keeps it: a claimed
batch's row locks live in a transaction, but LISTEN, the session settings (timeouts,
``enable_sort = off``) and fencing by server pid (``pg_terminate_backend``) need the same
server connection from one statement to the next. PgBouncer in ``pool_mode = transaction``
(or ``statement``, which refuses transactions outright) hands each transaction to whichever
server connection is free: LISTEN never wakes, the settings land on another client's
connection, and a pid could name a connection another client uses at that moment.

Nothing in the protocol says a pooler is there (and users run PgBouncer on 5432 too), so
this is found from behaviour: a session of our own keeps its server pid between
transactions, and no other connection gets that pid while ours is open. One connection
``probe`` notes its pid; then, a few times, another holds a transaction open (keeping a
server connection to itself) and reports its pid, and ``probe`` asks again. A transaction
pooler shows itself either way: PgBouncer reuses the most recently used server connection
(its default) and gives ``probe``'s to the holder; with ``server_round_robin`` it gives the
least recently used one, to the holder or to ``probe``'s next transaction, within two
rounds. On a direct connection, or PgBouncer in session mode, neither can happen, so there
is no false alarm. At most two connections are open at once (a session pool of two is
enough), and none waits longer than ``CONNECT_TIMEOUT``.
"""

from __future__ import annotations

from typing import Any

import psycopg

from outbox.errors import ConfigError
from outbox.store.dsn import error_line, redact
from outbox.store.queries import query

_OWN: set[str] = set()  # DSNs found to give sessions of their own, in this process
ROUNDS = 3  # times a second connection holds a transaction open while the probe asks again
CONNECT_TIMEOUT = 10  # seconds; a pooler with no server connection free makes a login wait


def _pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(query("server_pid", "public"), prepare=False).fetchone()
    assert row is not None
    return int(row[0])


def shares_sessions(dsn: str) -> bool:
    """True when connections to ``dsn`` share server sessions between transactions."""
    connect = {"application_name": "outbox-probe", "connect_timeout": CONNECT_TIMEOUT}
    with psycopg.connect(dsn, autocommit=True, **connect) as probe:  # type: ignore[arg-type]
        mine = _pid(probe)
        for _ in range(ROUNDS):
            with psycopg.connect(dsn, **connect) as holder:  # type: ignore[arg-type]
                try:
                    if _pid(holder) == mine:  # its transaction stays open until it closes
                        return True
                except psycopg.errors.ProtocolViolation:  # PgBouncer's statement mode refuses BEGIN
                    return True
                if _pid(probe) != mine:
                    return True
    return False


RELAY_NEEDS = "row locks, LISTEN, session settings, fencing by server pid"
# The console and the CLI pin each session's search_path (outbox.pinning): through a transaction
# pooler that setting would land on server connections other clients' transactions then run on.
COMMANDS_NEED = "its search_path is pinned for the session, which a transaction pooler hands to other clients"


def require_own_sessions(dsn: str, who: str = "the relay", needs: str = RELAY_NEEDS) -> None:
    """Refuse a DSN whose connections share server sessions, in one line saying what to give.
    A DSN found to give sessions of their own is not probed again in this process."""
    if dsn in _OWN:
        return
    try:
        shared = shares_sessions(dsn)
    except psycopg.OperationalError as exc:
        reason = error_line(exc, dsn)
        raise ConfigError(f"cannot connect to PostgreSQL ({redact(dsn)}): {reason}") from None
    if shared:
        raise ConfigError(
            f"--dsn: {redact(dsn)} hands each transaction to a different server session (a pooler "
            f"such as PgBouncer in pool_mode=transaction); {who} needs sessions of its own ({needs}): "
            "give it a direct DSN to PostgreSQL, or a PgBouncer database in pool_mode=session"
        )
    _OWN.add(dsn)
