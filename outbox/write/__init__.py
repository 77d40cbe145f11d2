"""The write side: ``enqueue`` and its kin (``writer``), once for every stack the application
holds (``stacks``: psycopg 3, psycopg2, asyncpg, SQLAlchemy, Django). The public names are
``outbox.enqueue``, ``outbox.enqueue_many`` and their async twins."""
