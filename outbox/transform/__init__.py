"""Transforms: an operator's Python function run on each event of matching topics before it is
routed (``outbox relay --transform 'GLOB=module:function'``). It may reshape the event, re-key or
re-route it (a new topic), or drop it (``None``: archived as filtered). What it raises, or returns
that is no valid event, makes the event a dead letter of kind ``transform_failed``."""

from outbox.transform.event import Event
from outbox.transform.spec import TRANSFORM_FAILED, Transform, Transforms, parse_transforms

__all__ = ["TRANSFORM_FAILED", "Event", "Transform", "Transforms", "parse_transforms"]
