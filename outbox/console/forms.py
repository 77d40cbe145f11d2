"""What the console's pages read from a request (filters, windows, actions) and how the values
they show are written (ages, times, payloads). Pure: no database, no Starlette routes."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from outbox.console import data
from outbox.errors import ConfigError
from outbox.operate import archive

PAYLOAD_SHOWN = 64 * 1024  # bytes of a payload a page shows (the rest: a download)


def _text(src: Any, name: str) -> str | None:
    value = src.get(name)
    return value.strip() if isinstance(value, str) and value.strip() else None


def time_of(text: str | None, name: str) -> dt.datetime | None:
    """An ISO time (UTC without a zone) or a duration ago (``2h``), as ``outbox replay`` takes them."""
    return archive.parse_time(text, name, dt.datetime.now(dt.timezone.utc)) if text else None


def window(src: Any) -> dict[str, Any]:
    """A replay window from a query string or form: since (required), until (default: now, fixed
    here, so that what the preview counted is what the action replays; never in the future),
    topic, key, and the highest archived id its preview counted (``upto``, the action's)."""
    now = dt.datetime.now(dt.timezone.utc)
    since = time_of(_text(src, "since"), "since")
    until = time_of(_text(src, "until"), "until") or now
    if since is not None:
        archive.check_window(since, until, now)
    upto = _text(src, "upto")
    return {
        "since": since,
        "until": until,
        "topic": _text(src, "topic"),
        "key": _text(src, "key"),
        "upto": int(upto) if upto and upto.isdigit() else None,
    }


def dead_filter(src: Any) -> data.DeadFilter:
    """The dead-letter filter of a query string or form (a form's high-water mark is its page's)."""
    ids = tuple(int(v) for v in (src.getlist("id") if hasattr(src, "getlist") else []) if str(v).isdigit())
    hw = _text(src, "hw")
    return data.DeadFilter(
        high_water=int(hw) if hw and hw.isdigit() else 0,
        topic=_text(src, "topic"),
        key=_text(src, "key"),
        error=_text(src, "error"),
        since=time_of(_text(src, "since"), "since"),
        until=time_of(_text(src, "until"), "until"),
        fingerprint=_text(src, "fingerprint"),
        ids=ids,
    )


def action(form: Any) -> tuple[str, data.DeadFilter]:
    """A dead-letter action's form: the action, and the selector bounded by the page's mark."""
    chosen = str(form.get("action", ""))
    if chosen not in data.ACTIONS:
        raise ConfigError(f"action: one of {', '.join(data.ACTIONS)}")
    selector = dead_filter(form)
    if not selector.high_water:
        raise ConfigError("hw: the page's high-water mark is missing")
    return chosen, selector


def count_of(text: str | None) -> int | None:
    """A count a redirect carries (``n=``), or None when it is not one."""
    return int(text) if text and text.isdigit() and len(text) < 19 else None


def _utf8(data: bytes, cut: bool) -> str | None:
    """``data`` as UTF-8 text, or None; when ``cut``, a character the cut split is left off."""
    for trim in range(4 if cut else 1):
        try:
            return data[: len(data) - trim].decode("utf-8")
        except UnicodeDecodeError:
            continue
    return None


def payload_view(payload: bytes) -> dict[str, Any]:
    """How a payload shows: pretty JSON, text, or hex, of its first :data:`PAYLOAD_SHOWN` bytes
    (``cut``: the rest is only a download away)."""
    shown, size = payload[:PAYLOAD_SHOWN], len(payload)
    cut = size > PAYLOAD_SHOWN
    text = _utf8(shown, cut)
    if text is None:
        return {"kind": "bytes", "text": shown.hex(" ", 2), "size": size, "cut": cut}
    if not cut:
        try:
            pretty = json.dumps(json.loads(text), indent=2, ensure_ascii=False)
            return {"kind": "json", "text": pretty, "size": size, "cut": cut}
        except ValueError:
            pass
    return {"kind": "text", "text": text, "size": size, "cut": cut}


def age(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


def when(value: dt.datetime | str | None) -> str:
    if value is None:
        return "–"
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    return value.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
