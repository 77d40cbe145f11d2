"""The relay: one loop over the outboxes of a database (``relay.Relay``, the composition root;
``loop.Loop``) and its parts, each named for what it owns (the scheduler, the intakes, the
dispatcher, the finisher, the ledger, the recorder, the roster, upkeep, health, lanes, batches,
ordering, limits), the fleet of databases (``fleet``), its configuration and retry policy, and its
gauges and HTTP endpoints.

Nothing is imported here: ``import outbox`` takes the retry policy from this package without the
relay's weight. docs/architecture.md draws the parts and their threads."""
