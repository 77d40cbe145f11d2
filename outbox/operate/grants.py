"""The grants audit (``outbox migrate --check-grants``): who, outside the trusted roles, could put
code where the project's sessions would run it, and who could read WAL capture's signing keys.

Every session the project opens pins its search_path (:mod:`outbox.store.pinning`) and every schema it
uses is checked for its owner (:mod:`outbox.store.trust`), so these grants no longer let anyone run
code as the relay, the console or the migrator. They still matter: the application's own
sessions resolve names along ``"$user", public``, other software in the database does too, and a
role that may create schemas can take a name before the project does. The audit says who could,
and what with; revoking is the operator's call (docs/security.md, "PostgreSQL's own seams").
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.store.migrate import DEFAULT_RELAY_ROLE
from outbox.store.queries import query
from outbox.store.schema import FLEET_SCHEMA


@dataclass(frozen=True)
class Finding:
    grantee: str | None  # None: PUBLIC, every role
    place: str  # database | schema | named | key | key_all_data
    name: str

    @property
    def who(self) -> str:
        return "PUBLIC (every role)" if self.grantee is None else f"role {self.grantee}"

    def line(self) -> str:
        """What this grant lets its holder do, in one line."""
        if self.place == "database":
            return (
                f"{self.who} may CREATE in database {self.name}: it can make a schema named after "
                'another role (first on that role\'s default search_path, "$user"), there plant '
                "overloads that beat pg_catalog's, or make outbox_fleet before the project does"
            )
        if self.place in ("key", "key_all_data"):
            how = (
                "as a member of pg_read_all_data (revoke that membership)"
                if self.place == "key_all_data"
                else "(`outbox migrate --roles` revokes it; or REVOKE ALL ON the two tables FROM it)"
            )
            return (
                f"{self.who} may read the WAL signing keys of outbox {self.name} (capture_key, "
                f"capture_keys) {how}: with them it can sign messages the relay delivers as events"
            )
        if self.place == "named":
            return (
                f"{self.who} owns schema {self.name}, named after another role: it is first on that "
                "role's default search_path, and what is planted there runs on that role's unpinned "
                "sessions"
            )
        if self.name == "public":
            return (
                f"{self.who} may CREATE in schema public, on every role's default search_path: "
                "overloads there beat pg_catalog's wherever a call needs a cast, on every session "
                "that does not pin its path (an application's, other software's)"
            )
        if self.name == FLEET_SCHEMA:
            return (
                f"{self.who} may CREATE in {FLEET_SCHEMA}, the relays' membership: a trigger there "
                "would run as every relay (relays and migrate refuse the schema while this holds)"
            )
        return (
            f"{self.who} may CREATE in the outbox schema {self.name}: code there would run as the relay "
            "and the console (they refuse the outbox while this holds)"
        )


def audit(
    conn: psycopg.Connection[Any],
    schemas: Collection[str],
    owners: Collection[str] = (),
    relay: str = DEFAULT_RELAY_ROLE,
) -> list[Finding]:
    """Grants to roles outside the trusted ones (``owners``, else the connecting role and the
    database's owner; superusers always) on the database, public, ``schemas`` and outbox_fleet;
    and the roles but ``relay`` (and the roles in it) that may read ``schemas``' signing keys."""
    rows = conn.execute(
        query("grants_audit", "public"), {"schemas": list(schemas), "owners": list(owners), "relay": relay}
    ).fetchall()
    return [Finding(grantee, place, name) for grantee, place, name in rows]
