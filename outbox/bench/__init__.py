"""``outbox bench``: measure the relay against the baselines, in the same run; and the fault suite.

Scenarios (``--scenarios``): drain, steady, snapshot, writer, soak, scale, sinks, console,
tenants. Without
``--dsn`` / ``--kafka-bootstrap`` it starts an embedded PostgreSQL and the
embedded broker. ``--smoke`` shrinks every scenario to seconds (CI checks that
each runs and produces its outputs; it never asserts a timing).

The package imports nothing heavy: ``outbox.bench.cli`` registers the commands,
and the runners (``runner``, ``faults.suite``) import psutil and matplotlib
(the ``outbox-relay[bench]`` extra) only when a command runs.
"""
