"""Shared test settings: deterministic, single-threaded-friendly, CPU fp32."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
