"""``outbox bench explore``: a seeded schedule explorer.

A seed draws a schedule (:mod:`.schedule`): relays and their settings, the keys, the writer, a
scripted sink's behaviour, faults and operator actions. :mod:`.world` plays it against the real
relay (the ``outbox relay`` command, one process per relay) on a PostgreSQL of its own, with the
scripted sink (:mod:`.sink`) loaded into each relay through ``--sink``. The sink writes what a
receiver would have received to a journal as it sends, so a killed relay loses nothing of it.
:mod:`.checker` then checks the invariants from the writer's record, the journal, the tables and
the relays' logs; it shares no code with the relay. :mod:`.search` runs seeds, shrinks a failing
schedule, and prints the command that replays it.

Anchors: FoundationDB's deterministic simulation and TigerBeetle's VOPR (a seed reproduces a
schedule), Jepsen and Elle (a checker apart from the system under test). Unlike those, the relay
runs for real (threads, a server, signals): a seed reproduces the schedule, not every interleaving
of it, so a violation found once is replayed by running its seed again, usually more than once.
"""
