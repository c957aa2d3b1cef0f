"""Lines of a JSONL file read with a cap: a record (one line) may be any length on disk,
but no more than ``cap`` + 1 bytes of it are ever in memory at once.

:func:`bounded_lines` gives each line, or, for one longer than the cap, its size after
reading the rest of it in blocks of DISCARD_BYTES and dropping them; :func:`too_long`
is the bad-record reason that names the cap and the flag that raises it
(``--max-record-bytes``). Used by the JSONL readers of ``prepare``
(:mod:`tinylm.data.readers`) and the chat records (:mod:`tinylm.data.chat`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import IO

DISCARD_BYTES = 1 << 20  # the blocks in which a record over the cap is read and dropped


def too_long(size: int, cap: int) -> str:
    """The bad-record reason of a record of ``size`` bytes over the cap of ``cap`` bytes."""
    return (f"longer than the {cap:,}-byte record cap ({size:,} bytes; raise the cap "
            f"with --max-record-bytes)")


def bounded_lines(f: IO[bytes], cap: int) -> Iterator[bytes | int]:
    """The lines of ``f`` (line break included), each read in at most ``cap`` + 1 bytes:
    a line of more than ``cap`` bytes before its break comes as its size in bytes
    instead, read on in blocks of DISCARD_BYTES and dropped, so no line is ever held
    whole in memory however long it is."""
    for line in iter(functools.partial(f.readline, cap + 1), b""):
        if len(line) <= cap or line.endswith(b"\n"):
            yield line
        else:
            yield discard_rest(f, len(line))


def discard_rest(f: IO[bytes], size: int) -> int:
    """Read the rest of a line whose first ``size`` bytes were read, in blocks of
    DISCARD_BYTES, keeping none; the line's size."""
    while block := f.readline(DISCARD_BYTES):
        size += len(block)
        if block.endswith(b"\n"):
            break
    return size


__all__ = ["DISCARD_BYTES", "bounded_lines", "discard_rest", "too_long"]
