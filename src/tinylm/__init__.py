"""tinylm: GPT-style language models from the attention equations up.

The model, its config and errors, checkpoints and sampling import with the package;
``train`` (:func:`tinylm.training.loop.train`), ``evaluate``
(:func:`tinylm.use.evaluation.evaluate`) and ``prepare``
(:func:`tinylm.data.pipeline.prepare`) import on first use, so ``import tinylm`` does not
load the training loop (nor, by itself, the data pipeline).
"""

from __future__ import annotations

__version__ = "0.1.0"

from tinylm.core.config import ModelConfig  # noqa: E402
from tinylm.core.errors import CheckpointError, ConfigError, DataError, TinyLMError  # noqa: E402
from tinylm.core.model import GPT  # noqa: E402
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import save_checkpoint  # noqa: E402
from tinylm.use.sampling import generate, generate_stream  # noqa: E402

#: The exports imported on first use: name -> the module that defines it.
_LAZY = {
    "train": "tinylm.training.loop",
    "evaluate": "tinylm.use.evaluation",
    "prepare": "tinylm.data.pipeline",
}

__all__ = [
    "GPT",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "ModelConfig",
    "TinyLMError",
    "load_checkpoint",
    "save_checkpoint",
    "__version__",
    "generate",
    "generate_stream",
    *_LAZY,
]


def __getattr__(name: str) -> object:
    """``tinylm.train``, ``tinylm.evaluate``, ``tinylm.prepare``: imported when first asked
    for, then kept as ordinary attributes."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
