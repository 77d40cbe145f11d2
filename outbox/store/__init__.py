"""The outbox's database: schema names, the named SQL (``sql/``, ``queries``), migrations, the
sessions the project opens (their ``search_path`` pinned: ``pinning``; a pooler refused:
``pooling``), whose schemas are trusted (``trust``), which outboxes a relay serves
(``outboxes``), and the relay's database-side threads (``listener``, ``hygiene``)."""
