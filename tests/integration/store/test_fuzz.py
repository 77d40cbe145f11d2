"""Bad input, fuzzed: every enqueue either names the bad field and writes nothing, or
round-trips byte-exact through the relay to the broker. Corrupted rows are dead-lettered."""

from __future__ import annotations

import json
import math
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import outbox
from outbox.relay.relay import RelayConfig
from tests.helpers import count, read_topic, running_relay, wait_for

FIELDS = ("topic", "payload", "key", "headers", "delay")

# Any code point, lone surrogates and NUL included (the default text strategy skips surrogates).
any_char = st.characters(exclude_categories=())


def any_text(max_size: int, min_size: int = 0) -> st.SearchStrategy[str]:
    return st.text(alphabet=any_char, min_size=min_size, max_size=max_size)


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.floats()
    | st.integers(min_value=-(10**5000), max_value=10**5000)
    | any_text(20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
payloads = st.binary(max_size=300) | any_text(300) | json_values | st.sets(st.integers(), max_size=2)
keys = (
    st.none()
    | st.text(max_size=40)
    | st.binary(max_size=40)
    | st.integers()
    | st.text(min_size=4097, max_size=4200)
)
header_values = st.text(max_size=20) | st.binary(max_size=20) | st.integers()
headers = st.none() | st.dictionaries(
    st.text(min_size=0, max_size=12) | st.integers(), header_values, max_size=4
)
delays = (
    st.none()
    | st.floats(allow_nan=True, allow_infinity=True, min_value=None, max_value=None)
    | st.timedeltas(min_value=timedelta(seconds=-5), max_value=timedelta(seconds=0))
)
topics = any_text(12) | st.just("ok") | st.text(min_size=250, max_size=260) | st.binary(max_size=3)


def _expected_payload(payload: Any) -> tuple[bytes, bool]:
    if isinstance(payload, bytes):
        return payload, False
    if isinstance(payload, str):
        return payload.encode("utf-8"), False
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return text.encode("utf-8"), True


def _as_bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


def test_enqueue_fuzzed_errors_name_the_field_or_round_trip(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    accepted: dict[str, dict[str, Any]] = {}
    rejected = 0

    @settings(max_examples=250, deadline=None, suppress_health_check=list(HealthCheck))
    @given(t=topics, payload=payloads, key=keys, hdrs=headers, delay=delays)
    def check(t: Any, payload: Any, key: Any, hdrs: Any, delay: Any) -> None:
        nonlocal rejected
        real_topic = topic if t == "ok" else t
        # Delays would keep accepted events from being delivered during the test.
        if isinstance(delay, float) and math.isfinite(delay) and delay >= 0:
            delay = 0.0
        if isinstance(delay, timedelta) and delay >= timedelta(0):
            delay = None
        with psycopg.connect(pg_dsn) as conn:
            before = count(pg_dsn, schema, "events")
            try:
                eid = outbox.enqueue(
                    conn, real_topic, payload, key=key, headers=hdrs, delay=delay, schema=schema
                )
            except (TypeError, ValueError) as exc:
                rejected += 1
                message = str(exc)
                assert any(message.startswith(f) for f in FIELDS), message
                conn.execute("SELECT 1")  # the transaction is still usable
                conn.rollback()
                assert count(pg_dsn, schema, "events") == before, "a rejected event was written"
                return
            conn.commit()
        body, is_json = _expected_payload(payload)
        want_headers = {name: _as_bytes(v) for name, v in (hdrs or {}).items()}
        if is_json:
            want_headers.setdefault("content-type", b"application/json")
        accepted[str(eid)] = {
            "topic": real_topic,
            "key": _as_bytes(key) if key is not None else None,
            "value": body,
            "headers": want_headers,
        }

    check()
    assert rejected > 0 and accepted, (rejected, len(accepted))
    ours = {e for e, a in accepted.items() if a["topic"] == topic}
    assert ours, "no accepted event on the test topic"
    # Other topics (random text) may be invalid for Kafka: those are dead-lettered. Random
    # keys repeat, and a keyed dead letter would park its key's later events (by design,
    # tested in test_ordering): here every event must settle, so dead letters do not park.
    config = RelayConfig(pg_dsn, schema=schema, poll_interval=0.1, on_dead="continue")
    with running_relay(config, bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=60, what="drain")
    got = {m.event_id: m for m in read_topic(kafka, topic, len(ours))}
    assert set(got) == ours
    for eid in ours:
        m, want = got[eid], accepted[eid]
        assert m.key == want["key"]
        assert m.value == want["value"]
        assert {k: v for k, v in m.headers.items() if k != "event-id"} == want["headers"]


def test_corrupted_rows_are_dead_lettered_with_a_reason(
    pg_dsn: str, schema: str, kafka: str, topic: str
) -> None:
    with psycopg.connect(pg_dsn) as conn:
        outbox.enqueue(conn, topic, b"before", schema=schema)
        for bad in ("[1, 2]", '{"h": 5}', '{"h": {"b64": "!!"}}', '{"h": {"x": "y"}}'):
            conn.execute(
                f'INSERT INTO "{schema}".events (event_id, topic, payload, headers) '
                "VALUES (gen_random_uuid(), %s, 'x', %s::jsonb)",
                (topic, bad),
            )
        conn.execute(
            f'INSERT INTO "{schema}".events (event_id, topic, payload) VALUES (gen_random_uuid(), %s, %s)',
            ("", b"empty topic"),
        )
        outbox.enqueue(conn, topic, b"after", schema=schema)
    with running_relay(RelayConfig(pg_dsn, schema=schema, poll_interval=0.1), bootstrap=kafka):
        wait_for(lambda: count(pg_dsn, schema, "events") == 0, timeout=30)
    with psycopg.connect(pg_dsn) as conn:
        errors = [r[0] for r in conn.execute(f'SELECT error FROM "{schema}".dead_letters ORDER BY id')]
    assert len(errors) == 5
    assert all(e.startswith("corrupt event row:") for e in errors), errors
    assert sum("headers" in e for e in errors) == 4 and "topic" in errors[-1]
    # No key: the two valid events may sit in different Kafka partitions, in any order.
    assert sorted(m.value for m in read_topic(kafka, topic, 2)) == [b"after", b"before"]


hostile_names = st.sampled_from(
    [
        'x"; DROP SCHEMA public CASCADE; --',
        "x'); DROP TABLE t; --",
        "$$; SELECT pg_sleep(10); $$",
        "\nCREATE TABLE public.injected (x int); --",
        "\r; DROP TABLE IF EXISTS public.injected; --",
        "50%",
        'a"b',
        "Mixed Case",
        "with space",
        "ünïcödé-名前",
        "semi;colon",
        "back\\slash",
        "%(schema)s",
        "{schema}",
        "pg_mine",
        "",
        "a" * 57,
        "x\x00y",
    ]
)
schema_names = hostile_names | any_text(20, min_size=1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=schema_names)
def test_any_schema_name_is_an_identifier_or_a_clear_error(pg_dsn: str, name: str) -> None:
    """Schema names reach SQL only as quoted identifiers: a hostile name makes a schema with
    exactly that name and nothing else happens; a name PostgreSQL cannot take is refused
    before any SQL runs, with an error that names the field."""
    from psycopg import sql

    from outbox.operate.dead import Selector, select
    from outbox.operate.status import collect
    from outbox.store.migrate import migrate
    from outbox.store.schema import validate_schema

    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        existing = {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace").fetchall()}
        if name in existing:
            return
        try:
            validate_schema(name)
        except (TypeError, ValueError) as exc:
            assert str(exc).startswith("schema: "), exc
            try:
                migrate(conn, name)
            except (TypeError, ValueError) as again:
                assert str(again) == str(exc)
            else:
                raise AssertionError(f"migrate accepted {name!r}")
            with pytest.raises((TypeError, ValueError), match=r"^schema: "):
                outbox.enqueue(conn, "t", b"x", schema=name)
            assert {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace").fetchall()} == existing
            return
        tables = conn.execute("SELECT count(*) FROM pg_tables").fetchone()
        try:
            migrate(conn, name)
            with conn.transaction():
                outbox.enqueue(conn, "t", b"x", key="k", schema=name)
            assert collect(conn, name)["pending"] == 1
            assert select(conn, name, Selector(everything=True)) == []
            now = {r[0] for r in conn.execute("SELECT nspname FROM pg_namespace").fetchall()}
            assert now - existing == {name} and existing <= now
            assert (
                conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname <> %s", (name,)).fetchone()
                == tables
            ), "a table outside the schema changed"
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(name)))
