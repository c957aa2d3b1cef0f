"""A replaced layer made plain again: the one way every kind builds its dense ``nn.Linear``;
and the one way a checkpoint's config.json section rebuilds its replaced layers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.errors import CheckpointError, ConfigError


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


class DequantizingLinear(nn.Module):
    """A linear layer that stores its weight in another form (int8 codes, GGUF blocks) and
    computes with it dequantized: a subclass gives ``weight`` (O, I, the dequantized
    weight) and ``bias``; its forward is ``nn.Linear``'s math in the input's dtype."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype),
                        None if self.bias is None else self.bias.to(x.dtype))

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weight (same function)."""
        return dense_linear(self.weight, self.bias)


def replace_named_layers(model: nn.Module, entries: Any, section: str, kind: type,
                         build: Callable[[nn.Module, str, Any], nn.Module]) -> nn.Module:
    """Apply config.json's ``section`` entry ({layer name: its settings}) to ``model``:
    each named layer (an ``nn.Linear``, or already a ``kind``) becomes
    ``build(layer, name, settings)``, uninitialised (loading the state dict fills it).
    A malformed entry, a name that is not such a layer, or settings ``build`` refuses
    (a ConfigError, or its own CheckpointError) is one CheckpointError."""
    if not isinstance(entries, dict):
        raise CheckpointError(f"config.json's \"{section}\" entry must map layer names to "
                              f"their settings, got {entries!r}; the checkpoint is corrupt")
    for name, settings in entries.items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            layer = None
        if not isinstance(layer, (nn.Linear, kind)):
            raise CheckpointError(f"config.json's \"{section}\" entry names {name!r}, which "
                                  f"is not a linear layer of this model; the checkpoint is "
                                  f"corrupt or mixes files from different models")
        try:
            new = build(layer, name, settings)
        except ConfigError as exc:
            raise CheckpointError(f"config.json's \"{section}\" settings of {name!r} are "
                                  f"invalid ({exc}); the checkpoint is corrupt") from exc
        model.set_submodule(name, new)
    return model
