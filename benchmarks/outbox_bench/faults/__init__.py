"""``outbox bench faults``: break things under load and count what was lost.

Each scenario runs on its own schema and topic: writer threads commit a business
row and its event per transaction at a steady rate (``outbox.harness.load``),
relay processes (``outbox relay``, the real CLI) publish them, and a consumer
reads the topic from the start (``outbox.harness.tap``). Once the relays are
ready, the load starts and the fault is injected. At the end the writers stop,
the outbox drains, and every event the writers saw commit is accounted for:

- delivered: unique ``event-id`` headers the consumer saw;
- archived: rows in ``delivered`` (and archived twice: must be 0);
- dead-lettered: rows in ``dead_letters`` (only the scenario's poison may die);
- duplicates: messages seen minus unique ones;
- lost: committed events neither delivered nor dead-lettered;
- order violations: per key, the writer's sequence numbers must strictly rise
  in the broker's log order, after keeping first occurrences;
- time to recover: from the end of the fault until every event committed
  before it had reached the consumer.

A commit that fails with a broken connection may or may not have happened; the
writer keeps such events aside and the database decides at the end (an event
is committed if it is in ``events``, ``delivered`` or ``dead_letters``).

The in-memory broker loses what it holds when it stops. So that the broker
scenario measures the relay and not the memory broker, the relays are frozen
for a moment while the consumer catches up, and only then is the broker
stopped: everything the relay had been told was durable has been read.

A scenario passes only if nothing was lost, reordered or archived twice, and
the fault really happened (its row in ``SCENARIOS`` says what that means).
"""
