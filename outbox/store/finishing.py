"""A batch's outcomes written to its outbox's tables, in the batch's transaction: the delivered
archived (or deleted), the failed attempts' backoff persisted, the dead letters moved (parking
their keys with ``--on-dead park``). What each statement writes is decided by the batch
(:class:`outbox.relay.batch.Batch`); here is only how it is written.

Each statement checks the rows it changed: a batch's row locks are its lease, and a lease lost
(the session ended, another relay claimed the events) changes fewer rows than the batch holds,
which raises :class:`outbox.errors.FencingError` before anything commits."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg

from outbox.errors import FencingError
from outbox.store.queries import int_array, query


@dataclass
class Written:
    """A finished batch's outcomes, as lists of ids (and what goes with them) per statement."""

    archive: bool
    ok_ids: list[int]
    ok_parts: list[int | None]
    ok_offsets: list[int | None]
    ok_refs: list[str | None]
    ok_filtered: list[str | None]  # the transform that dropped each (empty: none was dropped)
    retry_ids: list[int]
    retry_delays: list[float]
    retry_errors: list[str]
    retry_kinds: list[str]
    dead_ids: list[int]
    dead_errors: list[str]
    dead_kinds: list[str]
    dead_events: list[tuple[int, str]]


def write(conn: psycopg.Connection[Any], schema: str, w: Written, *, parks: bool) -> None:
    """The outcomes' statements, in the batch's transaction (the caller commits)."""
    if w.ok_ids:
        name = "archive_delivered" if w.archive else "delete_delivered"
        cur = conn.execute(
            query(name, schema),
            {
                "ids": int_array(w.ok_ids),
                "partitions": int_array(w.ok_parts),
                "offsets": int_array(w.ok_offsets),
                # No sink reference at all (Kafka): an empty array, which unnest pads
                # with NULLs, instead of psycopg dumping a NULL per event in Python.
                "refs": [] if w.ok_refs.count(None) == len(w.ok_refs) else w.ok_refs,
                "filtered": w.ok_filtered,
            },
        )
        check_rows(cur.rowcount, len(w.ok_ids), "archive")
    write_failed(conn, schema, w, w.retry_ids, w.dead_ids, parks=parks)


def write_failed(
    conn: psycopg.Connection[Any],
    schema: str,
    w: Written,
    retry_ids: list[int],
    dead_ids: list[int],
    *,
    parks: bool,
) -> None:
    """The failed attempts (``retry_ids``: backoff persisted) and the dead letters (``dead_ids``,
    parking their keys when ``parks``), by their rows' ids."""
    if retry_ids:
        cur = conn.execute(
            query("schedule_retry", schema),
            {
                "ids": int_array(retry_ids),
                "delays": w.retry_delays,
                "errors": w.retry_errors,
                "kinds": w.retry_kinds,
            },
        )
        check_rows(cur.rowcount, len(retry_ids), "retry")
    if dead_ids:
        cur = conn.execute(
            query("dead_letter", schema),
            {"ids": int_array(dead_ids), "errors": w.dead_errors, "kinds": w.dead_kinds, "park": parks},
        )
        check_rows(cur.rowcount, len(dead_ids), "dead-letter")


def check_rows(changed: int, expected: int, what: str) -> None:
    if changed != expected:
        raise FencingError(f"{what} changed {changed} rows, expected {expected}: the batch's lease was lost")
