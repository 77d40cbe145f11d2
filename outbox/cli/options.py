"""Command-line options made from settings (``outbox.settings``), never restated by hand.

``add(parser, SomeSettings)`` adds one flag per field of a settings dataclass:
its flag, ``OUTBOX_*`` variable, type, default, choices and help all come from
the field. A value in the environment becomes the flag's default, so the
command line wins over the environment, which wins over the built-in default.
``build(SomeSettings, args)`` turns the parsed flags back into the object.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from typing import Any, TypeVar

from outbox.errors import ConfigError
from outbox.settings import Meta, env_of, flag_of, meta_of

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


@dataclasses.dataclass(frozen=True)
class Option:
    """One field made into a flag: where argparse stores it, and how it reads its variable."""

    name: str  # the field
    dest: str  # the argparse destination
    flag: str
    env: str
    kind: type
    item: type | None  # the element type of a list
    meta: Meta


def _kind(annotation: Any) -> tuple[type, type | None]:
    """(type, list element type) of a field annotation such as ``int | None`` or ``list[str]``."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _kind(args[0])
    if origin is list:
        return list, typing.get_args(annotation)[0]
    return annotation, None


def options_of(cls: type, env_prefix: str | None = None) -> list[Option]:
    """The command-line options of a settings dataclass (fields marked ``cli=False`` excluded)."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        meta = meta_of(f)
        if meta is None or not meta.cli:
            continue
        flag = flag_of(f.name, meta)
        env = meta.env or (env_prefix + f.name.upper() if env_prefix else env_of(f.name, meta))
        kind, item = _kind(hints[f.name])
        out.append(Option(f.name, flag[2:].replace("-", "_"), flag, env, kind, item, meta))
    return out


def _int_list(text: str) -> list[int]:
    """``1000,5000`` as [1000, 5000] (argparse turns the ValueError into a usage error)."""
    values = [int(x) for x in text.split(",") if x.strip()]
    if not values or any(v <= 0 for v in values):
        raise ValueError(text)
    return values


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return None  # computed when the object is built (e.g. host:pid), not at parse time
    return None


def _from_env(option: Option, text: str) -> Any:
    kind = option.kind
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{option.env}: expected true/false, got {text!r}")
    if kind is list:
        if option.item is int:
            try:
                return _int_list(text)
            except ValueError:
                raise ConfigError(
                    f"{option.env}: expected comma-separated positive integers, got {text!r}"
                ) from None
        return [text]
    try:
        value = kind(text)
    except ValueError:
        what = {int: "an integer", float: "a number"}.get(kind, kind.__name__)
        raise ConfigError(f"{option.env}: expected {what}, got {text!r}") from None
    if option.meta.choices and value not in option.meta.choices:
        raise ConfigError(f"{option.env}: must be one of {', '.join(option.meta.choices)}, got {text!r}")
    return value


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def add(
    parser: argparse.ArgumentParser, cls: type, *, env_prefix: str | None = None, overrides_only: bool = False
) -> list[Option]:
    """Add ``cls``'s options to ``parser``; returns them.

    ``overrides_only``: a flag left unset parses as None (the program then keeps
    its own default, e.g. a shorter one under ``--smoke``); ``--help`` still
    shows the field's default.
    """
    options = options_of(cls, env_prefix)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for option in options:
        f, meta = fields[option.name], option.meta
        default = None if overrides_only else _default(f)
        env_text = os.environ.get(option.env)
        if env_text is not None and env_text != "":
            default = _from_env(option, env_text)
        field_default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        shown = meta.default_text or (
            None if field_default in (None, [], dataclasses.MISSING) else _shown(field_default)
        )
        help_text = f"{meta.help} [{option.env}" + (f"; default {shown}]" if shown else "]")
        kwargs: dict[str, Any] = {"dest": option.dest, "default": default, "help": help_text}
        if option.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif option.kind is list and option.item is int:
            kwargs["type"] = _int_list
            kwargs.setdefault("metavar", "N[,N...]")
        elif option.kind is list:
            kwargs["action"] = "append"
            # Unset under overrides_only: None, so that the program's own default applies.
            kwargs["default"] = None if overrides_only and default is None else list(default or [])
        else:
            kwargs["type"] = option.kind
        if meta.choices:
            kwargs["choices"] = list(meta.choices)
        if meta.metavar:
            kwargs["metavar"] = meta.metavar
        parser.add_argument(option.flag, *meta.aliases, **kwargs)
    return options


def values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values by field name; unset optional fields left out (their default applies)."""
    out = {}
    for option in options_of(cls):
        if not hasattr(args, option.dest):
            continue
        value = getattr(args, option.dest)
        if value is not None:
            out[option.name] = value
    return out


def build(cls: type[T], args: argparse.Namespace, **fixed: Any) -> T:
    """An instance of ``cls`` from the parsed flags, with ``fixed`` fields set by the program."""
    return cls(**{**values(cls, args), **fixed})
