"""Traps for PostgreSQL's own seams: overloads of every pg_catalog function and operator the
project's SQL calls, planted where a role that may only CREATE could put them.

On PostgreSQL 14 and older every login role may create in ``public``, and a role that may create
schemas can make one named after another role, which is first on that role's default
``search_path`` (``"$user", public``). There, an overload whose argument types match a call
more exactly than pg_catalog's (``to_char(date, text)`` where pg_catalog has ``to_char(timestamp,
text)``; ``unnest(uuid[])`` where it has ``unnest(anyarray)``) is the one PostgreSQL calls, with
the caller's rights. A session that pins ``search_path = pg_catalog, pg_temp`` never looks there;
SQL that runs on an application's session (the writers, the inbox) calls pg_catalog's functions by
their qualified name.

The list of names is derived from the SQL itself (``outbox/store/sql/*.sql``, ``migrations/*.sql``), so
that a call added tomorrow is trapped tomorrow. For each pg_catalog overload of a name, the traps
take each argument's type, or any type PostgreSQL converts to it implicitly; a polymorphic
argument gets each of the common concrete types (its array for an array). Each trap counts its
calls in a sequence of its own (a sequence is not transactional: a call in a rolled-back
transaction still counts) and then does what pg_catalog's function does, so the run goes on as it
would under a real attacker, and every call is seen rather than only the first.
"""

from __future__ import annotations

import functools
import itertools
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
SOURCES = (
    *sorted((ROOT / "outbox" / "store" / "sql").glob("*.sql")),
    *sorted((ROOT / "migrations").glob("*.sql")),
)
COUNTERS = "outbox_trap"  # the schema of the counters (one sequence per trapped name)

# Concrete types a polymorphic argument is trapped with (and their arrays for an array argument).
POLYMORPHIC_AS = (
    "smallint", "integer", "bigint", "numeric", "double precision", "text", "character varying", "name",
    "bytea", "uuid", "jsonb", "boolean", "timestamp with time zone", "interval", "oid",
)  # fmt: skip
# ... and the extra arguments of a VARIADIC "any" function (format, concat): up to three of these.
VARIADIC_AS = ("text", "integer", "bigint", "name", "uuid")
VARIADIC_EXTRA = 3
MAX_VARIANTS = 400  # per overload; past it, one argument varies at a time
POLY_FAMILIES = {
    "anyelement": ("element", False),
    "anynonarray": ("element", False),
    "anyarray": ("element", True),
    "anycompatible": ("compatible", False),
    "anycompatiblenonarray": ("compatible", False),
    "anycompatiblearray": ("compatible", True),
    '"any"': ("any", False),
}
_COMMENT = re.compile(r"--[^\n]*")
_STRING = re.compile(r"'(?:[^']|'')*'|\$(\w*)\$.*?\$\1\$", re.S)
_PLACEHOLDER = re.compile(r"%\(\w+\)s|%s|%%|\$\d+|\{\w+\}|\{\{|\}\}")
_CALL = re.compile(r"(?<![\w.\"])([a-z_][a-z0-9_]*)\s*\(", re.I)
_OPERATOR = re.compile(r"(?<![\w)\]'\"])?([+\-*/<>=~!@#%^&|`?]+)")
# Not functions, though followed by "(": SQL's own syntax.
_SYNTAX = {
    "all", "and", "any", "array", "as", "by", "case", "cast", "coalesce", "conflict", "cube", "exists",
    "filter", "from", "greatest", "grouping", "in", "insert", "into", "join", "key", "least", "lateral",
    "not", "nullif", "of", "on", "or", "over", "partition", "primary", "references", "rollup", "row",
    "select", "set", "sets", "table", "then", "using", "values", "when", "where", "with", "within",
    "extract", "overlay", "position", "substring", "trim", "unique", "check", "default", "index",
    "returns", "function", "trigger", "execute", "perform", "return", "generated", "stored", "include",
    "exclude", "ordinality", "tablesample", "window", "rows", "range", "only", "else", "end", "between",
    "like", "ilike", "similar", "is", "distinct", "limit", "offset", "fetch", "for", "update", "delete",
    "copy", "format_type",
}  # fmt: skip


def _code(text: str) -> str:
    """SQL without comments, string literals and dollar-quoted bodies' quotes (bodies kept:
    a function's body calls functions too)."""
    text = _COMMENT.sub(" ", text)

    def keep_body(m: re.Match[str]) -> str:
        return (
            m.group(0)[len(m.group(1) or "") + 2 : -(len(m.group(1) or "") + 2)]
            if m.group(0)[0] == "$"
            else " "
        )

    # Dollar-quoted bodies are code (PL/pgSQL, SQL functions): unwrap them, then drop literals.
    text = _STRING.sub(keep_body, text)
    text = _STRING.sub(" ", text)
    return _PLACEHOLDER.sub(" ", text)


@functools.cache
def called() -> tuple[frozenset[str], frozenset[str]]:
    """(function names, operator names) the project's SQL may call, pg_catalog's or not."""
    functions: set[str] = set()
    operators: set[str] = set()
    for path in SOURCES:
        code = _code(path.read_text("utf-8"))
        functions.update(m.group(1).lower() for m in _CALL.finditer(code))
        code = re.sub(r"::\s*[\w\s\"\[\]]+", " ", code)  # casts are not operators
        operators.update(m.group(1) for m in _OPERATOR.finditer(code) if m.group(1) not in ("::",))
    return frozenset(functions - _SYNTAX), frozenset(operators)


@dataclass(frozen=True)
class Overload:
    """One trap: a function (or an operator's function) of ``name`` taking ``args``."""

    name: str
    args: tuple[str, ...]
    returns: str
    target: str  # pg_catalog's function (regprocedure) it stands in for
    target_args: tuple[str, ...]  # its argument types, to cast each argument back to
    setof: bool
    counter: str
    operator: str | None = None  # the operator it implements, when it is one


def _catalog(conn: psycopg.Connection[Any], names: Iterable[str]) -> list[tuple[Any, ...]]:
    return conn.execute(
        """
        SELECT p.proname, p.oid::regprocedure::text,
               ARRAY(SELECT pg_catalog.format_type(t, NULL) FROM pg_catalog.unnest(p.proargtypes) AS t),
               pg_catalog.format_type(p.prorettype, NULL), p.proretset,
               pg_catalog.format_type(p.provariadic, NULL), p.proargmodes IS NOT NULL
        FROM pg_catalog.pg_proc AS p
        WHERE p.pronamespace = 'pg_catalog'::regnamespace AND p.prokind = 'f'
          AND p.proname = ANY(%s::text[])
        ORDER BY 1, 2
        """,
        (sorted(names),),
    ).fetchall()


def _implicit_sources(conn: psycopg.Connection[Any]) -> dict[str, list[str]]:
    rows = conn.execute(
        """
        SELECT pg_catalog.format_type(c.casttarget, NULL), pg_catalog.format_type(c.castsource, NULL)
        FROM pg_catalog.pg_cast AS c JOIN pg_catalog.pg_type AS s ON s.oid = c.castsource
        WHERE c.castcontext = 'i' AND s.typtype = 'b' AND s.typname !~ '^(reg|pg_|_)'
          AND s.typnamespace = 'pg_catalog'::regnamespace
        """
    ).fetchall()
    out: dict[str, list[str]] = {}
    for target, source in rows:
        out.setdefault(target, []).append(source)
    return out


def _pseudo(conn: psycopg.Connection[Any]) -> set[str]:
    rows = conn.execute(
        "SELECT pg_catalog.format_type(oid, NULL) FROM pg_catalog.pg_type WHERE typtype = 'p'"
    ).fetchall()
    return {r[0] for r in rows}


def _variants(
    args: tuple[str, ...], variadic: str | None, sources: dict[str, list[str]], pseudo: set[str]
) -> Iterator[tuple[tuple[str, ...], dict[str, str]]]:
    """Argument lists a trap of this overload takes: each argument's own type or an implicit
    source of it; polymorphic ones concrete (consistently within a family); the variadic tail
    (only "any": concrete arrays are a plain last argument) as up to three plain arguments."""
    fixed = args[:-1] if variadic == '"any"' else args
    families = {POLY_FAMILIES[a][0] for a in fixed if a in POLY_FAMILIES and a != '"any"'}
    for a in fixed:
        if a in pseudo and a not in POLY_FAMILIES:
            return  # internal, cstring, trigger, anyenum, anyrange ...: no trap
    tails: list[tuple[str, ...]] = [()]
    if variadic == '"any"':
        tails = [t for n in range(VARIADIC_EXTRA + 1) for t in itertools.product(VARIADIC_AS, repeat=n)]
    for chosen in itertools.product(POLYMORPHIC_AS, repeat=len(families)):
        bound = dict(zip(sorted(families), chosen, strict=True))
        per_arg: list[list[str]] = []
        for a in fixed:
            if a == '"any"':
                per_arg.append(list(POLYMORPHIC_AS))
            elif a in POLY_FAMILIES:
                family, array = POLY_FAMILIES[a]
                per_arg.append([bound[family] + ("[]" if array else "")])
            else:
                per_arg.append([a, *sources.get(a, [])])
        total = 1
        for options in per_arg:
            total *= len(options)
        if total <= MAX_VARIANTS:
            lists: Iterable[tuple[str, ...]] = itertools.product(*per_arg)
        else:  # one argument varies, the others keep their first (own) type
            lists = (
                tuple(o if j == i else per_arg[j][0] for j in range(len(per_arg)))
                for i in range(len(per_arg))
                for o in per_arg[i]
            )
        for head in lists:
            for tail in tails:
                yield head + tail, bound
        if not families:
            break


def _concrete(returns: str, bound: dict[str, str]) -> str:
    """A polymorphic result type, as the trap's concrete arguments make it."""
    if returns not in POLY_FAMILIES:
        return returns
    family, array = POLY_FAMILIES[returns]
    return bound[family] + ("[]" if array else "")


def overloads(conn: psycopg.Connection[Any]) -> list[Overload]:
    """Every trap for the names the SQL calls: functions, then the functions behind operators."""
    functions, operators = called()
    sources, pseudo = _implicit_sources(conn), _pseudo(conn)
    existing = {(name, tuple(args)) for name, _, args, *_ in _catalog(conn, functions)}
    out: list[Overload] = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for name, target, args, returns, setof, variadic, modes in _catalog(conn, functions):
        if name.startswith("pg_") and name.endswith("_in"):
            continue
        variadic = None if variadic == "-" else variadic
        if (modes and variadic != '"any"') or returns in pseudo - {"void", "anyelement", "anyarray"}:
            continue  # OUT parameters, or a result a trap cannot declare (record, internal ...)
        if returns in ("anyelement", "anyarray") and not any(a in POLY_FAMILIES for a in args):
            continue
        for variant, bound in _variants(tuple(args), variadic, sources, pseudo):
            key = (name, variant)
            if key in seen or key in existing:
                continue
            seen.add(key)
            out.append(
                Overload(name, variant, _concrete(returns, bound), target, tuple(args), setof, f"f_{name}")
            )
    for opname, left, right, target, fn_args, returns in conn.execute(
        """
        SELECT o.oprname, pg_catalog.format_type(o.oprleft, NULL), pg_catalog.format_type(o.oprright, NULL),
               o.oprcode::regprocedure::text,
               ARRAY(SELECT pg_catalog.format_type(t, NULL) FROM pg_catalog.unnest(p.proargtypes) AS t),
               pg_catalog.format_type(o.oprresult, NULL)
        FROM pg_catalog.pg_operator AS o JOIN pg_catalog.pg_proc AS p ON p.oid = o.oprcode
        WHERE o.oprnamespace = 'pg_catalog'::regnamespace AND o.oprname = ANY(%s::text[])
          AND o.oprleft <> 0 AND o.oprright <> 0
        """,
        (sorted(operators),),
    ).fetchall():
        if returns in pseudo - {"anyelement", "anyarray"}:
            continue
        args = (left, right)
        taken = {
            (o, (lt, rt))
            for o, lt, rt in conn.execute(
                "SELECT oprname, pg_catalog.format_type(oprleft, NULL), pg_catalog.format_type(oprright, NULL) "
                "FROM pg_catalog.pg_operator WHERE oprnamespace = 'pg_catalog'::regnamespace AND oprname = %s",
                (opname,),
            ).fetchall()
        }
        for variant, bound in _variants(args, None, sources, pseudo):
            key = (opname, variant)
            if key in seen or key in taken:
                continue
            seen.add(key)
            counter = "o_" + "_".join(f"{ord(c):x}" for c in opname)
            out.append(
                Overload(
                    f"trap_op_{len(out)}",
                    variant,
                    _concrete(returns, bound),
                    target,
                    tuple(fn_args),
                    False,
                    counter,
                    opname,
                )
            )
    return out


def _definition(schema: str, o: Overload) -> sql.Composed:
    params = sql.SQL(", ").join(sql.SQL(t) for t in o.args)
    target_name = o.target.split("(", 1)[0]
    calls = []
    for i, (given, wanted) in enumerate(zip(o.args, o.target_args, strict=False), start=1):
        # Cast back to pg_catalog's type where it is concrete (a polymorphic one takes it as is).
        cast = "" if wanted in POLY_FAMILIES or given == wanted else "::" + wanted
        calls.append(f"${i}{cast}")
    calls += [f"${i}" for i in range(len(o.target_args) + 1, len(o.args) + 1)]  # a variadic tail
    qualified = target_name if target_name.startswith("pg_catalog.") else "pg_catalog." + target_name
    body = (
        f"SELECT pg_catalog.nextval('{COUNTERS}.{o.counter}'); "
        f"SELECT {'* FROM ' if o.setof else ''}{qualified}({', '.join(calls)})"
    )
    returns = sql.SQL(("SETOF " if o.setof else "") + o.returns)
    statement = sql.SQL("CREATE FUNCTION {}.{}({}) RETURNS {} LANGUAGE sql AS {}").format(
        sql.Identifier(schema), sql.Identifier(o.name), params, returns, sql.Literal(body)
    )
    if o.operator is None:
        return statement
    return sql.Composed(
        [
            statement,
            sql.SQL("; CREATE OPERATOR {}.{} (LEFTARG = {}, RIGHTARG = {}, FUNCTION = {}.{})").format(
                sql.Identifier(schema),
                sql.SQL(o.operator),
                sql.SQL(o.args[0]),
                sql.SQL(o.args[1]),
                sql.Identifier(schema),
                sql.Identifier(o.name),
            ),
        ]
    )


def plant(conn: psycopg.Connection[Any], schemas: Iterable[str], attacker: str) -> int:
    """Plant every trap in each of ``schemas`` (made if missing, owned by ``attacker``, usable by
    everyone, as an attacker's would be), with the counters. ``conn``: a superuser's, in the
    database to trap. Returns how many traps each schema holds."""
    conn.execute("SET search_path = pg_catalog, pg_temp")
    conn.execute("SET check_function_bodies = off")  # 20,000 bodies: each was checked when called
    traps = overloads(conn)
    conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(COUNTERS)))
    conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO PUBLIC").format(sql.Identifier(COUNTERS)))
    for counter in sorted({o.counter for o in traps}):
        name = sql.Identifier(COUNTERS, counter)
        conn.execute(sql.SQL("CREATE SEQUENCE IF NOT EXISTS {}").format(name))
        conn.execute(sql.SQL("GRANT USAGE, UPDATE ON SEQUENCE {} TO PUBLIC").format(name))
    for schema in schemas:
        conn.execute(
            sql.SQL("CREATE SCHEMA IF NOT EXISTS {} AUTHORIZATION {}").format(
                sql.Identifier(schema), sql.Identifier(attacker)
            )
        )
        conn.execute(sql.SQL("GRANT USAGE ON SCHEMA {} TO PUBLIC").format(sql.Identifier(schema)))
        conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(attacker)))  # the attacker's own
        for start in range(0, len(traps), 500):  # several statements a round trip
            conn.execute(sql.SQL("; ").join(_definition(schema, o) for o in traps[start : start + 500]))
        conn.execute("RESET ROLE")
    conn.execute("RESET search_path")
    conn.execute("RESET check_function_bodies")
    return len(traps)


def fired(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """Calls each trapped name took so far (only those called)."""
    rows = conn.execute(
        "SELECT c.relname FROM pg_catalog.pg_class AS c WHERE c.relkind = 'S' "
        "AND c.relnamespace = %s::regnamespace",
        (COUNTERS,),
    ).fetchall()
    out: dict[str, int] = {}
    for (name,) in rows:
        row = conn.execute(
            sql.SQL("SELECT last_value, is_called FROM {}").format(sql.Identifier(COUNTERS, name))
        ).fetchone()
        if row is not None and row[1]:
            out[_readable(name)] = int(row[0])
    return out


def _readable(counter: str) -> str:
    kind, _, rest = counter.partition("_")
    if kind == "o":
        return "operator " + "".join(chr(int(c, 16)) for c in rest.split("_"))
    return rest + "()"
