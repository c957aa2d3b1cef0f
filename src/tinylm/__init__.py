"""tinylm: GPT-style language models from the attention equations up."""

from __future__ import annotations

__version__ = "0.1.0"

from tinylm.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from tinylm.config import ModelConfig  # noqa: E402
from tinylm.errors import CheckpointError, ConfigError, DataError, TinyLMError  # noqa: E402
from tinylm.model import GPT  # noqa: E402
from tinylm.sampling import generate, generate_stream  # noqa: E402

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
]
