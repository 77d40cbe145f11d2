"""What the demo, the benchmark and the fault suite share: servers, load and a consumer.

- :mod:`~outbox.harness.infra`: PostgreSQL and a broker, embedded or given,
  with the means to restart or stop them;
- :mod:`~outbox.harness.load`: an app that commits a business row and its
  event per transaction at a steady rate, per key in sequence;
- :mod:`~outbox.harness.tap`: a consumer that reads a topic from the start and
  remembers what arrived, when, and where it sits in the broker's log.
"""
