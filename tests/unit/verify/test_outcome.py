"""The verdicts of `outbox verify`, on made-up records: no broker, no database."""

from __future__ import annotations

from outbox.verify.outcome import EXPIRED, MISSING, PRESENT, Archived, Held, Verdict, judge
from outbox.verify.redis import stream_id
from outbox.verify.run import Lost, Pace, Report

EVENT = Archived(7, "e-1", "orders", b"k", b'{"n":1}', 0, 41, None)


def test_the_same_event_is_present_another_or_none_is_missing() -> None:
    assert judge(EVENT, Held("e-1", b"k", b'{"n":1}', key_returned=True)) == Verdict(PRESENT)
    assert judge(EVENT, None).outcome == MISSING
    assert judge(EVENT, Held("e-2")) == Verdict(MISSING, "another event (e-2) at its coordinates")
    assert judge(EVENT, Held(None)).reason == "another event (without an event-id) at its coordinates"


def test_payload_and_key_are_compared_where_returned_unless_ids_only() -> None:
    other_payload = Held("e-1", b"k", b'{"n":2}', key_returned=True)
    assert judge(EVENT, other_payload) == Verdict(MISSING, "the record there has another payload")
    assert judge(EVENT, other_payload, compare_bodies=False) == Verdict(PRESENT)
    assert (
        judge(EVENT, Held("e-1", None, b'{"n":1}', key_returned=True)).reason
        == "the record there has another key"
    )
    assert judge(EVENT, Held("e-1", None, None)) == Verdict(PRESENT)  # the sink returns neither


def test_a_sinks_text_in_a_reason_is_bounded() -> None:
    reason = judge(EVENT, Held("x" * 10_000)).reason
    assert reason is not None and len(reason) < 120


def test_entry_ids_order_as_redis_orders_them() -> None:
    assert stream_id("1700000000000-2") == (1700000000000, 2)
    assert stream_id(b"5-0") < stream_id("5-1") < stream_id("6-0")  # type: ignore[operator]
    assert stream_id("10-0") > stream_id("9-99")  # type: ignore[operator]
    assert stream_id("") is None and stream_id("x-y") is None and stream_id(None) is None


def test_the_pace_sleeps_what_the_rate_asks_and_never_without_one() -> None:
    now = [0.0]
    slept: list[float] = []
    pace = Pace(1000, clock=lambda: now[0], sleep=slept.append)
    pace.took(500)
    assert slept == [0.5]
    now[0] = 2.0  # slower than the rate: no sleep
    pace.took(500)
    assert slept == [0.5]
    free = Pace(0, clock=lambda: 0.0, sleep=slept.append)
    free.took(10**6)
    assert slept == [0.5]


def test_the_json_summary_has_the_fixed_keys() -> None:
    import datetime as dt

    report = Report(
        dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc), dt.datetime(2026, 1, 2, tzinfo=dt.timezone.utc)
    )
    report.add(EVENT, "kafka://k:9092", Verdict(PRESENT))
    report.add(EVENT, "kafka://k:9092", Verdict(MISSING, "nothing at its coordinates"))
    report.add(EVENT, "kafka://k:9092", Verdict(EXPIRED, "trimmed"))
    assert report.as_json() == {
        "checked": 3,
        "present": 1,
        "missing": ["e-1"],
        "expired": 1,
        "unverifiable": 0,
    }
    assert report.missing == [Lost(7, "e-1", "orders", "kafka://k:9092", "nothing at its coordinates")]
    assert report.by_place[("orders", "kafka://k:9092")] == {PRESENT: 1, MISSING: 1, EXPIRED: 1}


def test_the_window_is_read_in_slices_each_delivery_once_in_order() -> None:
    """Slices against a made-up archive: bursts, gaps and many deliveries in one millisecond."""
    import datetime as dt
    import random

    from outbox.verify.run import Slices

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    rnd = random.Random(7)
    rows, i = [], 0
    for burst in range(40):  # bursts of up to 3,000 deliveries, hours apart at times
        at = t0 + dt.timedelta(seconds=burst * rnd.choice([1, 30, 900, 7200]))
        for _ in range(rnd.randint(0, 3000)):
            i += 1
            rows.append((at + dt.timedelta(microseconds=rnd.randint(0, 2000)), i))
    rows.sort()
    until = rows[-1][0] + dt.timedelta(seconds=1)
    slices, seen, statements = Slices(t0, until, 1000), [], 0
    while (bounds := slices.next()) is not None:
        statements += 1
        after = (slices.after_at, slices.after_id)
        got = [r for r in rows if bounds[0] <= r[0] < bounds[1] and r > after][:1000]
        seen += got
        slices.read(got[-1][0] if got else None, got[-1][1] if got else None, len(got))
    assert seen == rows and statements < len(rows) / 100
