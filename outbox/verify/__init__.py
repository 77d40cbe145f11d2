"""``outbox verify``: delivered events read back from their sinks.

The archive keeps where each event went (Kafka's partition and offset, a JetStream stream and
sequence, a Redis Streams entry id). A broker loses acknowledged writes too (an unclean leader
election, a restart without persistence, a purge by hand): each event of a window is read back
at its coordinates and judged (:mod:`~outbox.verify.outcome`), a sink at a time
(:mod:`~outbox.verify.kafka`, :mod:`~outbox.verify.redis`, :mod:`~outbox.verify.nats`), by
:mod:`~outbox.verify.run`; what is missing can be queued again under its own event id
(:mod:`~outbox.verify.repair`).
"""
