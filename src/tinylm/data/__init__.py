"""Text to token ids: tokenizers, built-in corpora, input readers, token shards, the
``prepare`` pipeline and its prepared format, chat records and templates, batches.

The modules, in the order they build on each other:

    tokenizers  corpora  readers  shards     text in: tokenizers, corpora, inputs, shards
    format                                   the prepared folder (meta.json, PreparedData)
    options  plan                            prepare's options (PrepareOptions), checked
    encoding  pool  scan  pipeline           prepare(): cut + encode, the worker pool,
                                             pass 1, the phases
    batches                                  get_batch, iter_windows
    chat  chatdata  instructions             conversations, --chat data, python-qa

The names below are exported here, each imported on first use (``from tinylm.data
import prepare`` loads the pipeline, not the chat modules).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "prepare": "pipeline",
    "PrepareOptions": "options",
    "PreparedData": "format",
    "load_prepared": "format",
    "read_meta": "format",
    "dtype_for_vocab": "format",
    "FORMAT": "format",
    "get_batch": "batches",
    "iter_windows": "batches",
    "safe_split": "encoding",
    "default_workers": "pool",
}

if TYPE_CHECKING:
    from tinylm.data.batches import get_batch, iter_windows
    from tinylm.data.encoding import safe_split
    from tinylm.data.format import FORMAT, PreparedData, dtype_for_vocab, load_prepared, read_meta
    from tinylm.data.options import PrepareOptions
    from tinylm.data.pipeline import prepare
    from tinylm.data.pool import default_workers


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = [
    "FORMAT",
    "PreparedData",
    "PrepareOptions",
    "default_workers",
    "dtype_for_vocab",
    "get_batch",
    "iter_windows",
    "load_prepared",
    "prepare",
    "read_meta",
    "safe_split",
]
