"""Shared test settings: deterministic, single-threaded-friendly, CPU fp32; the real model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# The suite's process runs many trainings among everything else: it keeps glibc's own heap
# behaviour, so that memory one test's steps freed is not held for the rest of the suite
# (tinylm.training.heap; tests/test_heap.py runs the kept heap in fresh processes).
os.environ.setdefault("TINYLM_HEAP", "default")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


#: Where ``make smollm2-gguf`` (and so ``make test``) puts the real model's file.
DEFAULT_SMOLLM2 = Path.home() / ".cache" / "tinylm" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def real_model_path(variable: str = "TINYLM_SMOLLM2_GGUF") -> Path:
    """The real SmolLM2-135M-Instruct GGUF that ``make test`` fetches: the path in
    ``variable``, else where the Makefile caches it. Absent, the test fails, saying how to
    fetch it: a missing file never passes as green, nor as skipped."""
    path = os.environ.get(variable)
    found = Path(path) if path else DEFAULT_SMOLLM2
    if not found.is_file():
        pytest.fail(f"the real model is not here ({found}); 'make smollm2-gguf' fetches it "
                    f"(make test does), or point {variable} at SmolLM2-135M-Instruct.Q4_1.gguf")
    return found


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """The real SmolLM2 GGUF file (see :func:`real_model_path`)."""
    return real_model_path()
