"""``--transform GLOB=module:function``: which function each topic's events go through, loaded
once at start, and one event run through it."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from outbox.errors import ConfigError, InvalidEvent, InvalidEventType
from outbox.events import ClaimedEvent
from outbox.transform.event import Event, from_event, to_event

TRANSFORM_FAILED = "transform_failed"  # the dead letter kind of an event its transform failed on
MAX_REASON = 500  # characters of the exception's message kept in the reason


class TransformFailed(Exception):
    """The function raised, or returned no valid event: the reason names which and why."""


@dataclass(frozen=True)
class Transform:
    """One ``GLOB=module:function``."""

    glob: str
    target: str  # module:function, as given
    function: Callable[[Event], Event | None]

    @property
    def text(self) -> str:
        return f"{self.glob}={self.target}"

    def matches(self, topic: str) -> bool:
        return fnmatchcase(topic, self.glob)

    def run(self, claimed: ClaimedEvent) -> ClaimedEvent | None:
        """``claimed`` as the function returns it (the same object when it changed nothing), or
        None: dropped. Raises TransformFailed."""
        before = to_event(claimed)
        try:
            after = self.function(before)
        except Exception as exc:  # the operator's code: any error is this event's failure
            message = str(exc)[:MAX_REASON]
            raise TransformFailed(
                f"transform {self.target} raised {type(exc).__name__}" + (f": {message}" if message else "")
            ) from None
        if after is None:
            return None
        if after is before:
            return claimed
        try:
            return from_event(claimed, before, after)
        except (InvalidEvent, InvalidEventType) as exc:
            raise TransformFailed(f"transform {self.target} returned an invalid event: {exc}") from None


class Transforms:
    """The transforms in the order given; an event goes through the first whose glob matches its
    topic (as routes match), or none."""

    def __init__(self, transforms: list[Transform]) -> None:
        self.transforms = transforms
        self._of: dict[str, Transform | None] = {}  # topic -> its transform, learnt on first sight

    def __bool__(self) -> bool:
        return bool(self.transforms)

    def of(self, topic: str) -> Transform | None:
        try:
            return self._of[topic]
        except KeyError:
            found = next((t for t in self.transforms if t.matches(topic)), None)
            if len(self._of) >= 10_000:  # topics are few; a writer's made-up ones are not kept forever
                self._of.clear()
            self._of[topic] = found
            return found


def parse_transforms(items: list[str]) -> Transforms:
    """``--transform`` values (each may hold several, separated by whitespace), loaded."""
    transforms = [parse_transform(text) for item in items for text in item.split()]
    globs = [t.glob for t in transforms]
    for glob in globs:
        if globs.count(glob) > 1:
            raise ConfigError(f"--transform {glob}=...: given twice")
    return Transforms(transforms)


def parse_transform(text: str) -> Transform:
    glob, sep, target = text.partition("=")
    glob, target = glob.strip(), target.strip()
    if not sep or not glob or not target:
        raise ConfigError(
            f"--transform {text!r}: expected GLOB=module:function, e.g. 'orders.*=myapp.hooks:redact'"
        )
    return Transform(glob, target, load_function(target, f"--transform {glob}={target}"))


def load_function(target: str, field: str) -> Callable[[Event], Event | None]:
    """``module:function`` imported; ConfigError naming ``field`` when it cannot be."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{field}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module's own code failing on import
        raise ConfigError(f"{field}: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from None
    found: Any = module
    for part in attr.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise ConfigError(f"{field}: module {module_name!r} has no {attr!r}")
    if not callable(found):
        raise ConfigError(f"{field}: {attr!r} is not callable")
    function: Callable[[Event], Event | None] = found
    return function
