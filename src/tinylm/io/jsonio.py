"""Reading JSON a user may have damaged or planted: size and nesting bounded, errors typed.

The JSON files of the io room and those after it (a checkpoint's config.json, capped at
16 MiB by :mod:`tinylm.io.checkpoint`) go through :func:`read_json` or
:func:`parse_json`, so that a huge file, a 100,000-deep ``[[[[...`` or invalid UTF-8 ends
in one :class:`TinyLMError` line instead of a ``MemoryError`` or ``RecursionError``. The
data room, to the left of io, bounds its own: a tokenizer.json at 64 MiB
(:data:`tinylm.data.tokenizer_files.MAX_TOKENIZER_BYTES`), a prepared folder's meta.json
and a tokenizer_config.json at 16 MiB, a JSONL record at ``--max-record-bytes``. A leaf
module: it imports only :mod:`tinylm.core.errors`, so every module of io and after may
use it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tinylm.core.errors import DataError, TinyLMError

#: Default bounds. tinylm's own files are far smaller: a config.json is a few hundred
#: bytes, nests 3 deep; a 200k-token BPE tokenizer.json is ~20 MB and nests 5 deep.
MAX_BYTES = 256 * 1024 * 1024
MAX_DEPTH = 64


def _depth_exceeds(value: Any, max_depth: int) -> bool:
    """Whether ``value`` nests lists/dicts deeper than ``max_depth`` (iteratively)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > max_depth:
            return True
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return False


def parse_json(text: str | bytes, *, source: str = "JSON text",
               error: type[TinyLMError] = DataError, fix: str = "",
               max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """The value of a JSON document, or ``error`` with one line naming ``source``.

    ``fix`` is appended to every message (e.g. "restore it or retrain"). Refuses text
    over ``max_bytes`` bytes, nesting deeper than ``max_depth`` lists/objects, invalid
    UTF-8 and integers too long for Python to parse.
    """
    tail = f"; {fix}" if fix else ""
    size = len(text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text)
    if size > max_bytes:
        raise error(f"{source} is {size:,} bytes, more than the {max_bytes:,} tinylm reads "
                    f"from a JSON file{tail}")
    try:
        value = json.loads(text)
    except RecursionError:
        raise error(f"{source} nests lists/objects deeper than tinylm reads "
                    f"(at most {max_depth}){tail}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{source} is not UTF-8 text ({exc.reason} at byte {exc.start}){tail}") \
            from None
    except ValueError as exc:  # json.JSONDecodeError, or an integer of 4,300+ digits
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "integer string conversion" in message:
            message = "an integer of more than 4,300 digits"
        raise error(f"{source} is not valid JSON ({message}){tail}") from None
    if _depth_exceeds(value, max_depth):
        raise error(f"{source} nests lists/objects deeper than tinylm reads "
                    f"(at most {max_depth}){tail}")
    return value


def read_json(path: str | os.PathLike, *, error: type[TinyLMError] = DataError,
              fix: str = "", max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> Any:
    """The value of the JSON file at ``path``, bounded as :func:`parse_json`.

    A missing file raises ``FileNotFoundError`` (callers say what a missing file means);
    any other problem reading or parsing it raises ``error`` with a one-line message.
    """
    p = Path(path)
    tail = f"; {fix}" if fix else ""
    try:
        size = p.stat().st_size
        if size > max_bytes:
            raise error(f"{p} is {size:,} bytes, more than the {max_bytes:,} tinylm reads "
                        f"from a JSON file{tail}")
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise
    except IsADirectoryError:
        raise error(f"{p} is a folder, not a JSON file{tail}") from None
    except OSError as exc:
        raise error(f"cannot read {p} ({exc.strerror or exc}){tail}") from None
    return parse_json(data, source=str(p), error=error, fix=fix, max_bytes=max_bytes,
                      max_depth=max_depth)
