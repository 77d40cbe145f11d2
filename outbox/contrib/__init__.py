"""Integrations with other tools' migrations: Django (an app) and Alembic (a helper)."""
