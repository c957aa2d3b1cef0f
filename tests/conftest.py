"""Shared test settings: deterministic, single-threaded-friendly, CPU fp32; the real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def real_model_path(variable: str = "TINYLM_SMOLLM2_GGUF") -> Path:
    """The real SmolLM2-135M-Instruct GGUF that ``make test`` fetches (its path in
    ``variable``). Absent: the test skips, or fails under ``TINYLM_REQUIRE_SMOLLM2=1``
    (what ``make test`` and so CI set), so a missing file can never pass as green."""
    path = os.environ.get(variable)
    if path and Path(path).is_file():
        return Path(path)
    message = (f"the real model is not here ({variable}={path!r}); 'make test' fetches it "
               f"('make smollm2-gguf'), or point {variable} at SmolLM2-135M-Instruct.Q4_1.gguf")
    if os.environ.get("TINYLM_REQUIRE_SMOLLM2") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2 GGUF file (see :func:`real_model_path`)."""
    return real_model_path()
