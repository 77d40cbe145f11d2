"""The next shared transaction's claims, sent while the batches of the one before are sent
(outbox.pipelined): they overlap, nothing is lost or sent twice, and claims sent ahead of a
stop are rolled back with nothing sent."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql

from outbox.events import ClaimedEvent
from outbox.relay.relay import Relay
from outbox.sinks.base import Outcome, Report, SinkWrapper
from outbox.sinks.kafka import KafkaSink
from outbox.store.outboxes import Outbox
from tests.helpers import assert_per_key_order, count, read_topic, running_relay, wait_for
from tests.integration.relay.test_shared_claims import PER_OUTBOX, _archived_once, _config, _outboxes

GROUP = 4  # --shared-outboxes: 12 outboxes are three shared transactions


class _Watching(SinkWrapper):
    """The real Kafka sink, noting at each send whether the relay's next claims were already out;
    with ``stop``, it stops the relay the first time they are."""

    def __init__(self, inner: KafkaSink, stop: bool = False) -> None:
        super().__init__(inner)
        self.relay: Relay | None = None
        self.stop = stop
        self.sends = 0
        self.with_claims_ahead = 0
        self.ahead_schemas: set[str] = set()  # the outboxes whose claims were out when it stopped

    def produce(self, event: ClaimedEvent, report: Report) -> Outcome | None:
        relay = self.relay
        if relay is not None:
            self.sends += 1
            ahead = relay.intake.ahead
            if ahead is not None:
                self.with_claims_ahead += 1
                if self.stop and not self.ahead_schemas:
                    self.ahead_schemas = {lane.schema for lane, _ in ahead.picks}
                    relay.stop()
        return self.inner.produce(event, report)


def _relay_sessions(pg_dsn: str) -> int:
    with psycopg.connect(pg_dsn) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE application_name = 'outbox-relay' AND datname = current_database()"
        ).fetchone()
    assert row is not None
    return int(row[0])


def _boxes(pg_dsn: str, prefix: str, topic: str) -> list[Outbox]:
    return _outboxes(pg_dsn, prefix, 3 * GROUP, topic)


def test_the_next_claims_run_while_a_shared_transaction_is_sent(
    pg_dsn: str, kafka: str, topic: str, prefix: str
) -> None:
    boxes = _boxes(pg_dsn, prefix, topic)
    n = len(boxes) * PER_OUTBOX
    sink = _Watching(KafkaSink(kafka, delivery_timeout=10.0))
    with running_relay(_config(pg_dsn, shared_outboxes=GROUP), lambda: sink, outboxes=boxes) as relay:
        sink.relay = relay
        wait_for(lambda: all(count(pg_dsn, o.schema, "events") == 0 for o in boxes), timeout=60, what="drain")
    assert sink.with_claims_ahead > 0, f"none of {sink.sends} sends had the next claims out"
    _archived_once(pg_dsn, boxes)
    messages = read_topic(kafka, topic, n)
    assert len(messages) == len({m.event_id for m in messages}) == n
    assert_per_key_order(messages)


def test_claims_sent_ahead_of_a_stop_are_rolled_back_with_nothing_sent(
    pg_dsn: str, kafka: str, topic: str, prefix: str
) -> None:
    """The relay stops while the next claims are out: their transaction is rolled back at once
    (not left to the lease), none of their events was sent, and the next relay sends each once."""
    boxes = _boxes(pg_dsn, prefix, topic)
    n = len(boxes) * PER_OUTBOX
    sink = _Watching(KafkaSink(kafka, delivery_timeout=10.0), stop=True)
    config = _config(pg_dsn, shared_outboxes=GROUP)
    with running_relay(config, lambda: sink, outboxes=boxes) as relay:
        sink.relay = relay
        wait_for(lambda: relay.stopping, timeout=60, what="the next claims out")
    left = relay.intake.ahead
    if left is not None:  # (closed, so that a regression fails here, not in the schemas' teardown)
        left.conn.close()
    assert left is None and sink.ahead_schemas
    assert _relay_sessions(pg_dsn) == 0  # (the claims' session was not left idle in its transaction)
    for schema in sink.ahead_schemas:
        assert count(pg_dsn, schema, "events") == PER_OUTBOX, schema  # all pending, as before
    with running_relay(config, bootstrap=kafka, outboxes=boxes):
        # Well within the lease (the claims' locks would have lasted that long): every outbox drains.
        assert config.lease > 20
        wait_for(lambda: all(count(pg_dsn, o.schema, "events") == 0 for o in boxes), timeout=20, what="drain")
    _archived_once(pg_dsn, boxes)
    messages = read_topic(kafka, topic, n)
    assert len({m.event_id for m in messages}) == n
    theirs = [
        m for m in messages if m.key is not None and m.key.decode().rsplit("-", 1)[0] in sink.ahead_schemas
    ]
    assert len(theirs) == len(sink.ahead_schemas) * PER_OUTBOX  # sent once: by the second relay
    assert_per_key_order(messages)


@pytest.mark.parametrize("outboxes", [1, 2])
def test_shared_outboxes_bounds_a_shared_transaction(
    pg_dsn: str, kafka: str, topic: str, prefix: str, outboxes: int
) -> None:
    """--shared-outboxes 1: every outbox claims alone; 2: no transaction archives three."""
    boxes = _outboxes(pg_dsn, prefix, 5, topic)
    with running_relay(_config(pg_dsn, shared_outboxes=outboxes), bootstrap=kafka, outboxes=boxes):
        wait_for(lambda: all(count(pg_dsn, o.schema, "events") == 0 for o in boxes), timeout=60, what="drain")
    _archived_once(pg_dsn, boxes)
    with psycopg.connect(pg_dsn) as conn:
        per_transaction: dict[str, set[str]] = {}
        for o in boxes:
            archived = sql.SQL("SELECT DISTINCT xmin::text FROM {}.delivered").format(
                sql.Identifier(o.schema)
            )
            for (xmin,) in conn.execute(archived):
                per_transaction.setdefault(xmin, set()).add(o.schema)
    assert max(map(len, per_transaction.values())) <= outboxes, per_transaction
