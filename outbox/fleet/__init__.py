"""Many databases' outboxes in one process: a relay per database (:mod:`outbox.relay`), one
/metrics, the list of outboxes kept up to date (:mod:`~outbox.fleet.fleet`). It sits above the
relay, which serves the outboxes of one database."""
