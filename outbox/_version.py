"""The version of the distribution ``outbox-relay``: its one source (pyproject reads it)."""

__version__ = "0.2.0"
