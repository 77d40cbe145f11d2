"""Every error outbox raises on purpose, in one place.

``OutboxError`` is the base of the errors a user can act on: the CLI prints
them as one line (no traceback) and exits with the class's ``exit_code``.
Anything else escaping the CLI is a bug and keeps its traceback.

Errors about a value a caller passed (an event field, an option, a schema
name) also derive from ``ValueError`` or ``TypeError``, so code that already
catches those keeps working; their message starts with the field's name.
"""

from __future__ import annotations


class OutboxError(Exception):
    """An expected error: its message says what is wrong and, where it can, what to do."""

    exit_code = 2


class ConfigError(OutboxError, ValueError):
    """A setting, option, route or name is not usable; the message names it."""


class InvalidEvent(OutboxError, ValueError):
    """An event passed to ``enqueue`` has a bad value; the message names the field."""


class InvalidEventType(OutboxError, TypeError):
    """An event passed to ``enqueue`` has a field of the wrong type; the message names it."""


class InvalidType(OutboxError, TypeError):
    """An argument (a schema name, a connection) has the wrong type; the message names it."""


class UnsupportedConnection(InvalidType):
    """``enqueue`` was given an object it cannot write through; the message lists what works."""


class OutsideTransaction(OutboxError, ValueError):
    """``enqueue`` was given a connection in autocommit mode, outside any transaction: the event
    would commit on its own, apart from the data it describes."""


class NotMigrated(ConfigError):
    """The schema lacks the outbox tables, or a migration this version ships."""


class SchemaTooNew(NotMigrated):
    """The schema holds a migration of a newer version than this one: a relay does not serve it."""


class MissingExtra(OutboxError, ImportError):
    """An optional feature needs a package that is not installed; the message names the extra."""

    def __init__(self, what: str, extra: str, *, install: str | None = None) -> None:
        # install: what to install when it is not an extra of outbox-relay (the bench's own).
        super().__init__(f"{what} needs: pip install '{install or f'outbox-relay[{extra}]'}'")
        self.extra = extra


class Cancelled(OutboxError):
    """The operator answered no, or there was nobody to ask and no ``--yes``."""


class NothingMatched(OutboxError):
    """A selector (of dead letters, of archived events) chose nothing."""

    exit_code = 1


class RelayFailed(OutboxError):
    """The relay stopped because it failed, not because it was asked to."""

    exit_code = 1


class FencingError(OutboxError, RuntimeError):
    """A state change touched other rows than the batch owns: its lease was lost."""

    exit_code = 1


class CorruptEvent(OutboxError, ValueError):
    """A row in the events table (or a WAL message) that the relay cannot turn into a message.
    ``kind``: the dead letter's error kind (``corrupt_event``, or ``unsigned_event`` for a WAL
    message whose signature does not verify)."""

    def __init__(self, message: str, kind: str = "corrupt_event") -> None:
        super().__init__(message)
        self.kind = kind


class StoreUnavailable(OutboxError):
    """A claim-check store could not take or give a payload now (retry later)."""

    exit_code = 1


class ClaimCheckRefused(OutboxError):
    """A claim-check reference that is malformed, or points outside the store the consumer
    follows: that message fails for good (it is not retried, and the consumer goes on)."""


__all__ = [
    "Cancelled",
    "ClaimCheckRefused",
    "ConfigError",
    "CorruptEvent",
    "FencingError",
    "InvalidEvent",
    "InvalidEventType",
    "InvalidType",
    "MissingExtra",
    "NotMigrated",
    "NothingMatched",
    "OutboxError",
    "OutsideTransaction",
    "RelayFailed",
    "SchemaTooNew",
    "StoreUnavailable",
    "UnsupportedConnection",
]
