"""Settings declared once: a dataclass field carries its help, its choices and its names.

``setting(default, "help")`` is a ``dataclasses.field`` whose metadata the
command line reads (``outbox.cli.options``): the flag (``--batch-size`` from
``batch_size``), the environment variable (``OUTBOX_BATCH_SIZE``), the type,
the default and the choices all come from the field, so ``--help``, the
environment and the code can never disagree.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import MISSING
from typing import Any

ENV_PREFIX = "OUTBOX_"


@dataclasses.dataclass(frozen=True)
class Meta:
    """What the command line needs to know of a setting besides its name, type and default."""

    help: str
    choices: Sequence[str] | None = None
    flag: str | None = None  # default: --<name with dashes>
    env: str | None = None  # default: OUTBOX_<NAME>
    metavar: str | None = None
    default_text: str | None = None  # how --help shows the default, when not the value itself
    cli: bool = True  # False: set by the program (or by a shared option), not a flag of its own
    aliases: tuple[str, ...] = ()  # other flags that set it too


def setting(
    default: Any = MISSING,
    help: str = "",
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    choices: Sequence[str] | None = None,
    flag: str | None = None,
    env: str | None = None,
    metavar: str | None = None,
    default_text: str | None = None,
    cli: bool = True,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field with its command-line metadata (see the module docstring)."""
    meta = {"outbox": Meta(help, choices, flag, env, metavar, default_text, cli, aliases)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def meta_of(f: dataclasses.Field[Any]) -> Meta | None:
    meta = f.metadata.get("outbox")
    return meta if isinstance(meta, Meta) else None


def flag_of(name: str, meta: Meta) -> str:
    return meta.flag or "--" + name.replace("_", "-")


def env_of(name: str, meta: Meta) -> str:
    return meta.env or ENV_PREFIX + name.upper()
