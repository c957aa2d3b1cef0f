"""A replaced layer made plain again: the one way every kind builds its dense ``nn.Linear``."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def dense_linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding ``weight`` (out, in) and ``bias`` (copied, on their device
    and dtype): what ``to_linear``/``merged`` of every replaced layer returns."""
    out_features, in_features = weight.shape
    layer = nn.Linear(in_features, out_features, bias=bias is not None,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if bias is not None:
            layer.bias.copy_(bias)
    return layer
