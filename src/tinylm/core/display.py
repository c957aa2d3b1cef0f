"""Names shown to a user, made safe to print: :func:`display_name`.

A file name may hold anything but ``/`` and NUL: a line break (which forges a second
line of output), a terminal escape sequence (which recolours or clears the screen), or a
bidirectional mark such as U+202E (which shows ``txt.exe`` as ``exe.txt``). Every room
prints names through this one function, so what a message shows is what is on disk,
one line, in order. A leaf module: the standard library only.
"""

from __future__ import annotations

import os
from pathlib import PurePath

#: Characters that change how the text around them is shown rather than showing
#: themselves: the bidirectional embeddings, overrides and isolates, the left-to-right,
#: right-to-left and Arabic letter marks, and the line and paragraph separators.
_INVISIBLE = frozenset(
    [chr(c) for c in range(0x202A, 0x202F)] + [chr(c) for c in range(0x2066, 0x206A)]
    + ["\u200e", "\u200f", "\u061c", "\u2028", "\u2029"]
)
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(c: str) -> str:
    if c in _SHORT:
        return _SHORT[c]
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _unsafe(c: str) -> bool:
    code = ord(c)
    return code < 0x20 or 0x7F <= code < 0xA0 or c in _INVISIBLE


def _encoded(text: str) -> bytes:
    """A name's bytes: undecodable bytes come back (``surrogateescape``, as the file
    system gave them); any other lone surrogate is spelled ``\\udNNN``."""
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace")


def display_name(name: str | bytes | os.PathLike[str] | os.PathLike[bytes]) -> str:
    """``name`` (a path, a str or bytes) as one printable line: bytes that are not UTF-8
    shown as ``\\xNN``; control characters (C0, DEL, C1: line breaks, ESC) and
    bidirectional marks escaped (``\\n``, ``\\x1b``, ``\\u202e``); everything else,
    accents, CJK and emoji included, as it is."""
    if isinstance(name, (bytes, bytearray)):
        raw = bytes(name)
    else:
        path = str(name) if isinstance(name, (str, PurePath)) else os.fspath(name)
        raw = path if isinstance(path, bytes) else _encoded(path)
    text = raw.decode("utf-8", errors="backslashreplace")
    if not any(_unsafe(c) for c in text):
        return text
    return "".join(_escape(c) if _unsafe(c) else c for c in text)


__all__ = ["display_name"]
