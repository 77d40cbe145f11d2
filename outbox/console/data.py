"""What the console reads and does, on one connection at a time: each page's queries (named
SQL in ``sql/console.sql``, and ``outbox status``'s own for the numbers both show) and the
dead-letter actions, through the same code path as the CLI (:func:`outbox.operate.dead.act`)."""

from __future__ import annotations

import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

import psycopg

from outbox.events import key_bytes, key_text
from outbox.operate import audit, dead, status
from outbox.store.queries import int_array, query

CHART_MINUTES = 60
TIMELINE_LIMIT = 200  # events per part of a key's timeline (pending, dead, latest delivered)
SNAPSHOT_WARN_SECONDS = 300.0  # an older snapshot holds back vacuum long enough to see bloat
EXACT_ROWS = 200_000  # past this many rows (the planner's estimate) a count is estimated
SAMPLE_ROWS = 20_000  # rows an estimate's sample of the events table's pages aims at
ACTIONS = ("redrive", "skip")


@dataclass(frozen=True)
class DeadFilter:
    """The dead-letter page's filters, and an action's selector (with a group's fingerprint or
    chosen ids), always bounded by the high-water mark of the page that showed them."""

    high_water: int
    topic: str | None = None
    key: str | None = None
    error: str | None = None  # a substring of the error, case-insensitive
    since: dt.datetime | None = None
    until: dt.datetime | None = None
    fingerprint: str | None = None
    ids: tuple[int, ...] = field(default_factory=tuple)

    def selector(self, action: str | None = None) -> dead.Selector:
        """The dead letters this filter chooses, up to its high-water mark, as the CLI chooses
        them (:class:`outbox.operate.dead.Selector`: one selection for both). Listed and skipped, those
        the relay could not verify as events of this outbox are among them; a redrive leaves
        them (the CLI takes one by id, knowingly: ``--include-unverified``)."""
        chosen = self._selector()
        return chosen if action == "redrive" else chosen.also_unverified()

    def _selector(self) -> dead.Selector:
        return dead.Selector(
            ids=self.ids,
            key=key_bytes(self.key),
            topic=self.topic,
            error=self.error,
            fingerprint=self.fingerprint,
            since=self.since,
            until=self.until,
            high_water=self.high_water,
            everything=True,
        )

    def query(self) -> dict[str, str]:
        """The page's own filters as query parameters (for links that narrow them further)."""
        given = {
            "key": self.key,
            "error": self.error,
            "since": None if self.since is None else self.since.isoformat(),
            "until": None if self.until is None else self.until.isoformat(),
        }
        return {k: v for k, v in given.items() if v is not None}

    def page(self, after: int | None = None) -> dict[str, Any]:
        """Query parameters of a page of this filter's list (after dead letter ``after``)."""
        given: dict[str, Any] = {"hw": self.high_water, "topic": self.topic, "fingerprint": self.fingerprint}
        given.update(self.query())
        if after is not None:
            given["after"] = after
        return {k: v for k, v in given.items() if v is not None}

    def audited(self, action: str) -> dict[str, Any]:
        """The selector of ``action`` as the audit trail keeps it (what was given, and the
        high-water mark)."""
        return self._selector().audited()


def estimate(conn: psycopg.Connection[Any], schema: str, table: str) -> int:
    """The planner's estimate of ``table``'s rows (no scan)."""
    row = conn.execute(query("console_estimate", schema, identifiers={"table": table})).fetchone()
    assert row is not None
    return int(row[0][0]["Plan"]["Plan Rows"])


def overview(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """Per topic: pending, retrying, dead, parked keys, oldest pending age, delivered in the last
    hour; the relay fleet; table health.

    Counted exactly while a table is small (up to :data:`EXACT_ROWS` by the planner's estimate).
    Past that the events per topic are estimated from a sample of the table's pages and the
    archive's size from the planner, and the page says so: an exact count would scan millions
    of rows on every refresh. The ages, the dead letters, the parked keys and the last hour are
    always exact (an index or a small table answers them).
    """
    events_rows = estimate(conn, schema, "events")
    archive_rows = estimate(conn, schema, "delivered")
    sampled = events_rows > EXACT_ROWS
    topics: dict[str, dict[str, Any]] = {}

    def topic(name: str) -> dict[str, Any]:
        return topics.setdefault(
            name,
            {"topic": name, "pending": 0, "retrying": 0, "dead": 0, "parked_keys": 0,
             "oldest_age_seconds": None, "delivered_last_hour": 0},
        )  # fmt: skip

    if sampled:
        percent = min(100.0, 100.0 * SAMPLE_ROWS / events_rows)
        rows = conn.execute(query("console_events_by_topic_sampled", schema), {"percent": percent}).fetchall()
        seen = sum(int(p) + int(r) for _, p, r in rows)
        scale = events_rows / seen if seen else 0.0
        for name, p, r in rows:
            topic(name).update(pending=round(int(p) * scale), retrying=round(int(r) * scale))
        ages = conn.execute(query("console_oldest_by_topic", schema), {"topics": list(topics)}).fetchall()
        for name, age in ages:
            topic(name)["oldest_age_seconds"] = age
    else:
        for name, p, r, age in conn.execute(query("console_events_by_topic", schema)).fetchall():
            topic(name).update(pending=int(p), retrying=int(r), oldest_age_seconds=age)
    for name, n, parked in conn.execute(query("console_dead_by_topic", schema)).fetchall():
        topic(name).update(dead=int(n), parked_keys=int(parked))
    for name, n in conn.execute(query("console_delivered_last_hour", schema)).fetchall():
        topic(name)["delivered_last_hour"] = int(n)
    for t in topics.values():
        age = t["oldest_age_seconds"]
        t["oldest_age_seconds"] = None if age is None else round(float(age), 1)
    ordered = [topics[name] for name in sorted(topics)]

    def one(name: str) -> Any:
        row = conn.execute(query(name, schema)).fetchone()
        return row[0] if row else None

    oldest = one("console_oldest_pending")
    archived = archive_rows if archive_rows > EXACT_ROWS else int(one("console_archived") or 0)
    totals = {
        "pending": sum(t["pending"] for t in ordered),
        "retrying": sum(t["retrying"] for t in ordered),
        "dead": sum(t["dead"] for t in ordered),
        "parked_keys": int(one("console_parked_keys") or 0),
        "oldest_age_seconds": None if oldest is None else round(float(oldest), 1),
        "delivered_last_hour": sum(t["delivered_last_hour"] for t in ordered),
        "archived": archived,
    }
    fleet = status.fleet(conn, schema)
    now = dt.datetime.now(dt.timezone.utc)
    for relay in fleet["relays"]:
        heartbeat = dt.datetime.fromisoformat(relay["heartbeat_at"])
        relay["heartbeat_age_seconds"] = round((now - heartbeat).total_seconds(), 1)
    table = status.health(conn, schema)
    snapshot = table["oldest_xmin_age_seconds"]
    table["snapshot_warning"] = snapshot is not None and snapshot > SNAPSHOT_WARN_SECONDS
    return {
        "topics": ordered,
        "totals": totals,
        "verification": verification(conn, schema, now),
        "estimated": {"events": sampled, "events_rows": events_rows, "archive": archive_rows > EXACT_ROWS},
        "status": {**fleet, "table": table},
    }


VERIFY_IDS_SHOWN = 10


def verification(conn: psycopg.Connection[Any], schema: str, now: dt.datetime) -> dict[str, Any] | None:
    """The latest `outbox verify` (the CLI's, or the relay's own): when, over which window, what
    it found, the first missing ids; None if the outbox was never verified."""
    row = conn.execute(query("verification_latest", schema)).fetchone()
    if row is None:
        return None
    at, via, since, until, checked, present, missing, expired, unverifiable, ids = row
    return {
        "age_seconds": round((now - at).total_seconds(), 1), "via": via,
        "hours": round((until - since).total_seconds() / 3600, 1), "checked": int(checked),
        "present": int(present), "missing": int(missing), "expired": int(expired),
        "unverifiable": int(unverifiable), "missing_ids": list(ids)[:VERIFY_IDS_SHOWN],
    }  # fmt: skip


def chart(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """Delivered per minute and topic over the last hour: uPlot's data (x: minutes, one series
    per topic, zero where nothing was delivered)."""
    rows = conn.execute(query("console_delivered_per_minute", schema)).fetchall()
    now = int(dt.datetime.now(dt.timezone.utc).timestamp()) // 60 * 60
    minutes = [now - 60 * (CHART_MINUTES - 1 - i) for i in range(CHART_MINUTES)]
    index = {m: i for i, m in enumerate(minutes)}
    series: dict[str, list[int]] = {}
    for topic, minute, n in rows:
        i = index.get(int(minute))
        if i is not None:
            series.setdefault(topic, [0] * CHART_MINUTES)[i] = int(n)
    return {"x": minutes, "series": series}


def high_water(conn: psycopg.Connection[Any], schema: str) -> int:
    row = conn.execute(query("console_dead_high_water", schema)).fetchone()
    return int(row[0]) if row else 0


def dead_groups(conn: psycopg.Connection[Any], schema: str, chosen: DeadFilter) -> list[dict[str, Any]]:
    """Dead letters grouped by topic and error fingerprint, filtered."""
    rows = conn.execute(query("console_dead_groups", schema), chosen.selector().params()).fetchall()
    return [
        {
            "topic": t,
            "fingerprint": f,
            "kind": kind,
            "count": int(n),
            "first": first,
            "last": last,
            "parked_keys": int(parked),
            "high_water": int(top),
            "keys": [key_text(k) for k in (keys or [])],
            "unverified": kind in dead.UNVERIFIED,
        }
        for t, f, kind, n, first, last, parked, top, keys in rows
    ]


def chosen_ids(
    conn: psycopg.Connection[Any], schema: str, chosen: DeadFilter, action: str | None = None
) -> list[int]:
    return dead.select(conn, schema, chosen.selector(action))


PAGE = 100  # dead letters listed one by one a page, when a group is opened


def dead_list(
    conn: psycopg.Connection[Any], schema: str, chosen: DeadFilter, after: int = 0
) -> dict[str, Any]:
    """A page of the chosen dead letters one by one (those after id ``after``), how many there
    are in all, and where the next page starts (None: this is the last)."""
    selector = chosen.selector()
    ids = dead.select(conn, schema, selector, after=after, limit=PAGE + 1)
    rows = conn.execute(
        query("console_dead_list", schema), {"ids": int_array(ids[:PAGE]), "limit": PAGE}
    ).fetchall()
    return {
        "total": dead.count(conn, schema, selector),
        "next": ids[PAGE - 1] if len(ids) > PAGE else None,
        "after": after,
        "rows": [
            {
                "id": int(i),
                "event_id": e,
                "topic": t,
                "key": key_text(k),
                "attempts": int(a),
                "error": err,
                "failed_at": f,
                "parked": bool(p),
                "unverified": kind in dead.UNVERIFIED,
                "kind": kind,
            }
            for i, e, t, k, a, err, f, p, kind in rows
        ],
    }


def preview(conn: psycopg.Connection[Any], schema: str, chosen: DeadFilter, action: str) -> dict[str, int]:
    """What ``action`` on ``chosen`` would touch: dead letters, their keys, the parked events
    after them."""
    ids = chosen_ids(conn, schema, chosen, action)
    row = conn.execute(query("console_preview", schema), {"ids": int_array(ids)}).fetchone()
    assert row is not None
    left = dead.count(conn, schema, chosen.selector()) - len(ids) if action == "redrive" else 0
    return {
        "dead_letters": int(row[0]),
        "keys": int(row[1]),
        "parked_events": int(row[2]),
        "unverified_left": left,  # chosen, but no verified event of this outbox: a redrive leaves them
    }


def act(conn: psycopg.Connection[Any], schema: str, action: str, chosen: DeadFilter, actor: str) -> int:
    """Redrive or skip what ``chosen`` selects (nothing above its high-water mark), audited, committed."""
    if action not in ACTIONS:
        raise ValueError(f"action: one of {ACTIONS}, got {action!r}")
    with conn.transaction():
        ids = chosen_ids(conn, schema, chosen, action)
        if not ids:
            return 0
        return dead.act(conn, schema, action, ids, chosen.audited(action), via="console", actor=actor)


def timeline(conn: psycopg.Connection[Any], schema: str, key: str) -> dict[str, Any]:
    """A key's events in order: the latest delivered (oldest first), its dead letters, then
    what is pending, each with what the page shows of it."""
    params = {"key": key_bytes(key), "limit": TIMELINE_LIMIT}
    delivered = [
        {
            "state": "delivered",
            "id": int(i),
            "event_id": e,
            "topic": t,
            "attempts": int(a),
            "at": at,
            "partition": part,
            "offset": off,
            "ref": ref,
            "created_at": c,
            "type": ty,
        }
        for i, e, t, a, at, part, off, ref, c, ty in conn.execute(
            query("console_key_delivered", schema), params
        ).fetchall()
    ]
    delivered.sort(key=lambda d: (d["at"], d["id"]))  # oldest first; ties (one microsecond) by id
    dead_letters = [
        {
            "state": "dead",
            "id": int(i),
            "event_id": e,
            "topic": t,
            "attempts": int(a),
            "error": err,
            "at": at,
            "parked": bool(p),
            "created_at": c,
            "type": ty,
        }
        for i, e, t, a, err, at, p, c, ty in conn.execute(query("console_key_dead", schema), params)
    ]
    pending = [
        {
            "state": "retrying" if int(a) else "pending",
            "id": int(i),
            "event_id": e,
            "topic": t,
            "attempts": int(a),
            "error": err,
            "at": at,
            "created_at": c,
            "type": ty,
        }
        for i, e, t, a, err, at, c, ty in conn.execute(query("console_key_pending", schema), params)
    ]
    parked_by = next((d for d in dead_letters if d["parked"]), None)
    if parked_by is not None:
        for p in pending:
            p["parked"] = p["id"] > parked_by["id"]
    return {
        "key": key,
        "delivered": delivered,
        "dead": dead_letters,
        "pending": pending,
        "parked_by": parked_by,
        "limit": TIMELINE_LIMIT,
    }


def event(
    conn: psycopg.Connection[Any], schema: str, event_id: str, *, key: str | None = None, scan: bool = False
) -> list[dict[str, Any]]:
    """Every row of ``event_id``: pending, dead, or archived (a replayed one has several).

    The archive is searched through the event's ``key`` (its index), or, with ``scan``, by
    reading it whole: it has no index on event ids (migration 0011 says why)."""
    rows = conn.execute(query("console_event", schema), {"event_id": event_id}).fetchall()
    if key is not None or scan:
        rows += conn.execute(
            query("console_event_archived", schema), {"event_id": event_id, "key": key_bytes(key)}
        ).fetchall()
    out = []
    for state, i, e, t, k, payload, headers, ty, subj, a, c, err, at, part, off, ref, parked, kind in rows:
        out.append(
            {
                "state": state,
                "id": int(i),
                "event_id": e,
                "topic": t,
                "key": key_text(k),
                "payload": bytes(payload),
                "headers": json.loads(headers) if headers else {},
                "type": ty,
                "subject": subj,
                "attempts": int(a),
                "created_at": c,
                "error": err,
                "at": at,
                "partition": part,
                "offset": off,
                "ref": ref,
                "parked": parked,
                "unverified": kind in dead.UNVERIFIED,
            }
        )
    return out


def trail(conn: psycopg.Connection[Any], schema: str, limit: int = 100) -> list[dict[str, Any]]:
    return audit.recent(conn, schema, limit)
