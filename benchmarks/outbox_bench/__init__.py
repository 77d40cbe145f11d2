"""``outbox bench``: measure the relay against the baselines, in the same run; and the fault suite.

Scenarios (``--scenarios``): drain, steady, snapshot, writer, soak, scale, sinks, console,
tenants. Without
``--dsn`` / ``--kafka-bootstrap`` it starts an embedded PostgreSQL and the
embedded broker. ``--smoke`` shrinks every scenario to seconds (CI checks that
each runs and produces its outputs; it never asserts a timing).

The package imports nothing heavy: ``outbox_bench.cli`` registers the commands,
and the runners (``runner``, ``faults.suite``) import psutil and matplotlib
(the bench's own dependencies: a --no-deps install may lack them) only when a command runs.
"""
