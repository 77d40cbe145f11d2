"""Untrusted text made safe to show: one function for every command's output and every log line.

A writer's topic, key, headers and payload, a stranger's WAL message, a webhook receiver's body, a
transform's exception: any of them may hold an escape sequence (a terminal would set its window
title, clear the screen, overwrite lines), a line break (a forged line in the relay's log), a
bidirectional override (text shown in another order than it is) or a character no encoder takes
(a lone surrogate). :func:`escape` writes each such character as a Python-style escape
(``\\x1b``, ``\\u202e``), and leaves everything else, backslashes included, as it is.
"""

from __future__ import annotations

import unicodedata

# The characters of these Unicode categories are escaped: control (C0, DEL, C1), format (bidi
# overrides, zero-width joiners), line and paragraph separators, surrogates, and unassigned or
# private-use code points (a terminal may draw them as anything).
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs", "Co", "Cn"})


def escape(text: str) -> str:
    """``text`` with every character a terminal or a log reader could take for an instruction (or
    a line end) written as an escape; plain printable text comes back as it is, at once."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch == " " else _escaped(ch) for ch in text)


def _escaped(ch: str) -> str:
    if unicodedata.category(ch) not in _ESCAPED_CATEGORIES:  # a space other than " " (no-break)
        return ch
    code = ord(ch)
    if code <= 0xFF:
        return f"\\x{code:02x}"
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def escape_lines(text: str, indent: str = "  ") -> str:
    """``text`` of several lines (a traceback), each line escaped and indented: none of them can
    pass for a line of its own in a log."""
    return "\n".join(indent + escape(line) for line in text.split("\n"))
