"""tinylm: GPT-style language models from the attention equations up."""

from __future__ import annotations

__version__ = "0.1.0"

from tinylm.core.config import ModelConfig  # noqa: E402
from tinylm.core.errors import CheckpointError, ConfigError, DataError, TinyLMError  # noqa: E402
from tinylm.core.model import GPT  # noqa: E402
from tinylm.io.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from tinylm.use.sampling import generate, generate_stream  # noqa: E402

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
