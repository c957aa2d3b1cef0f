"""tinylm: GPT-style language models from the attention equations up.

Every public name imports on first use (PEP 562's module ``__getattr__``): ``import
tinylm`` loads neither torch nor the training loop, so ``tinylm --help`` starts in a
fraction of a second; ``tinylm.GPT`` (or ``from tinylm import GPT``) imports
:mod:`tinylm.core.model` then, and ``train`` (:func:`tinylm.training.loop.train`),
``evaluate`` (:func:`tinylm.use.evaluation.evaluate`) and ``prepare``
(:func:`tinylm.data.pipeline.prepare`) likewise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: The public names: name -> the module that defines it, imported when first asked for.
_LAZY = {
    "GPT": "tinylm.core.model",
    "ModelConfig": "tinylm.core.config",
    "CheckpointError": "tinylm.core.errors",
    "ConfigError": "tinylm.core.errors",
    "DataError": "tinylm.core.errors",
    "TinyLMError": "tinylm.core.errors",
    "load_checkpoint": "tinylm.io.checkpoint",
    "save_checkpoint": "tinylm.io.checkpoint_files",
    "generate": "tinylm.use.sampling",
    "generate_stream": "tinylm.use.sampling",
    "train": "tinylm.training.loop",
    "evaluate": "tinylm.use.evaluation",
    "prepare": "tinylm.data.pipeline",
}

if TYPE_CHECKING:  # the names for type checkers and editors; never run
    from tinylm.core.config import ModelConfig
    from tinylm.core.errors import CheckpointError, ConfigError, DataError, TinyLMError
    from tinylm.core.model import GPT
    from tinylm.data.pipeline import prepare
    from tinylm.io.checkpoint import load_checkpoint
    from tinylm.io.checkpoint_files import save_checkpoint
    from tinylm.training.loop import train
    from tinylm.use.evaluation import evaluate
    from tinylm.use.sampling import generate, generate_stream

__all__ = [
    "GPT",
    "CheckpointError",
    "ConfigError",
    "DataError",
    "ModelConfig",
    "TinyLMError",
    "__version__",
    "evaluate",
    "generate",
    "generate_stream",
    "load_checkpoint",
    "prepare",
    "save_checkpoint",
    "train",
]


def __getattr__(name: str) -> object:
    """A public name, imported from its module when first asked for, then kept as an
    ordinary attribute."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
