"""The Django app: add ``"outbox.contrib.django"`` to ``INSTALLED_APPS`` and ``manage.py
migrate`` creates the outbox schema with the shipped SQL (the same as ``outbox migrate
--print``), recorded in ``<schema>.schema_migrations`` so that ``outbox migrate`` agrees.

Settings: ``OUTBOX_SCHEMA`` (default ``"outbox"``), the schema it creates; pass the same
name to ``enqueue(..., schema=...)`` and to the relay. ``OUTBOX_DATABASE`` (default
``"default"``): the database alias that holds the outbox; migrations on other
aliases skip it.
"""

from outbox.extras import require

require("django", "outbox.contrib.django")
