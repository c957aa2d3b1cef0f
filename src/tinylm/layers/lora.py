"""LoRA: low-rank adapters on a frozen model, y = x·W + b + (α / r)·x·A·B.

A :class:`LoRALinear` replaces one ``nn.Linear`` of a GPT (the attention's ``qkv`` and
``out``, the feed-forward's ``up`` and ``down``). It keeps the layer's frozen ``weight``
(F, E) and ``bias`` (F,) under the same names, so a checkpoint's keys for them do not
change, and adds two trainable matrices in the seed's x·W orientation:

    lora_A  (E, r)  random (Kaiming-uniform, as in the LoRA paper), so gradients reach B
    lora_B  (r, F)  zeros, so a fresh adapter leaves the model's output unchanged

A rank-r adapter on an E -> F layer has r·(E + F) parameters. :func:`merge_lora`
folds every adapter into its layer, W' = W + (α / r)·(A·B)ᵀ, giving back plain
``nn.Linear`` layers (the same logits within float rounding).

``LoRALinear`` is an ``nn.Module`` and deliberately not an ``nn.Linear`` (sub)class, so
nothing that takes a plain layer mistakes it for one. tinylm's fused training paths
(:mod:`tinylm.native.plan`) support it through :meth:`LoRALinear.effective_weight`,
W' = W + (α / r)·(A·B)ᵀ as one autograd expression: the fused block multiplies by W',
and autograd carries dL/dW' back to A and B (tested: the same gradients as this
module's own forward). The decoding paths step aside for it (merge first).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.layers.defaults import DEFAULT_TARGETS
from tinylm.layers.dense import dense_linear
from tinylm.layers.selection import select_layers

#: Short names for the layers LoRA can target, -> the module path inside a block.
TARGETS = {"qkv": "attn.qkv", "out": "attn.out", "up": "ffn.up", "down": "ffn.down"}
ADAPTER_SUFFIXES = (".lora_A", ".lora_B")


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable rank-r update: (…, E) -> (…, F).

    ``weight``/``bias`` are the frozen layer's (``nn.Linear`` orientation, (F, E));
    ``lora_A`` (E, r) and ``lora_B`` (r, F) are the adapter; ``scale`` is α / r.
    Constructed weights are uninitialised (B zero): build one with :meth:`from_linear`
    or load a state dict into it.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float,
                 bias: bool = True, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        self.alpha = float(alpha)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **kw),
                                   requires_grad=False)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.lora_A = nn.Parameter(torch.empty(in_features, rank, **kw))
        self.lora_B = nn.Parameter(torch.zeros(rank, out_features, **kw))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def from_linear(cls, layer: nn.Linear, rank: int, alpha: float) -> LoRALinear:
        """An adapter around ``layer`` (its weight and bias are copied and frozen); A is
        initialised as nn.Linear initialises a weight (fan-in E), B is zero."""
        new = cls(layer.in_features, layer.out_features, rank, alpha,
                  bias=layer.bias is not None, device=layer.weight.device,
                  dtype=layer.weight.dtype)
        nn.init.kaiming_uniform_(new.lora_A.data.T, a=math.sqrt(5))  # (r, E) view: fan-in E
        with torch.no_grad():
            new.weight.copy_(layer.weight)
            if layer.bias is not None:
                new.bias.copy_(layer.bias)
        return new

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight, self.bias)  # (…, E)·(E, F) + b -> (…, F)
        h = x @ self.lora_A  # (…, E)·(E, r) -> (…, r)
        return y + (h @ self.lora_B) * self.scale  # (…, r)·(r, F) -> (…, F)

    def effective_weight(self) -> Tensor:
        """W' = W + (α / r)·(A·B)ᵀ (F, E), the dense weight this layer computes with: a
        differentiable expression of A and B (the frozen W gets no gradient)."""
        return self.weight + (self.lora_A @ self.lora_B).t() * self.scale  # (E, F) -> (F, E)

    def merged(self) -> nn.Linear:
        """The equivalent plain layer, with weight W' (:meth:`effective_weight`)."""
        return dense_linear(self.effective_weight(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, alpha={self.alpha:g}, bias={self.bias is not None}")


def target_patterns(targets: str | Sequence[str]) -> tuple[str, ...]:
    """``"qkv,out"`` or ``["qkv", "out"]`` -> the checked layer patterns they stand for,
    ``("attn.qkv", "attn.out")`` (:data:`TARGETS`), for
    :func:`tinylm.layers.selection.select_layers`."""
    names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets)]
    bad = [t for t in names if t not in TARGETS]
    if bad or not names:
        raise ConfigError(f"LoRA targets {bad or names!r} are not layers LoRA can adapt; "
                          f"choose from {','.join(TARGETS)} (e.g. --lora-targets qkv,out)")
    return tuple(TARGETS[t] for t in dict.fromkeys(names))


def _check_rank(rank: Any, alpha: Any) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ConfigError(f"LoRA rank must be an integer >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not (
            math.isfinite(alpha) and alpha > 0):
        raise ConfigError(f"LoRA alpha must be a positive number, got {alpha!r}")


def _check_adaptable(name: str, layer: nn.Module, rank: int) -> None:
    if type(layer) is not nn.Linear:
        raise ConfigError(f"{name} is a {type(layer).__name__}, not a plain linear "
                          f"layer; LoRA adapts dense models (merge or decompress first)")
    if rank > min(layer.in_features, layer.out_features):
        raise ConfigError(f"LoRA rank {rank} exceeds {name}'s smaller side "
                          f"{min(layer.in_features, layer.out_features)}; use a "
                          f"smaller --lora-rank")


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None,
               targets: str | Sequence[str] = DEFAULT_TARGETS) -> nn.Module:
    """Freeze every parameter of ``model`` and put a rank-``rank`` adapter on the
    ``targets`` layers of every block (in place; returns ``model``). ``alpha``
    defaults to 2·rank (scale 2). The layers are chosen by the one selection rule
    (:func:`~tinylm.layers.selection.select_layers`, any module type, so that a replaced
    layer in a target's place is refused by name)."""
    alpha = 2 * rank if alpha is None else alpha
    _check_rank(rank, alpha)
    chosen = select_layers(model, target_patterns(targets), take=None)
    for name, layer in chosen:
        _check_adaptable(name, layer, rank)
    for p in model.parameters():
        p.requires_grad_(False)
    for name, layer in chosen:
        model.set_submodule(name, LoRALinear.from_linear(layer, rank, alpha))
    return model


def lora_structure(model: nn.Module) -> dict[str, Any]:
    """config.json's ``"lora"`` entry: {"layers": {name: rank}, "alpha": {name: α}}, or
    empty when the model has no adapter."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    if not layers:
        return {}
    return {"layers": {n: m.rank for n, m in layers.items()},
            "alpha": {n: m.alpha for n, m in layers.items()}}


def apply_lora_structure(model: nn.Module, structure: Any) -> nn.Module:
    """Rebuild the adapters config.json's ``"lora"`` entry describes (weights are then
    loaded from the checkpoint); the rest of the model is frozen, as in training."""
    if not isinstance(structure, dict) or not isinstance(structure.get("layers"), dict) \
            or not isinstance(structure.get("alpha"), dict):
        raise CheckpointError(f"config.json's \"lora\" entry is malformed ({structure!r:.80}); "
                              f"the checkpoint is corrupt")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, rank in structure["layers"].items():
        alpha = structure["alpha"].get(name)
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            layer = None
        if type(layer) is not nn.Linear:
            raise CheckpointError(f"config.json's \"lora\" entry names {name!r}, which is not "
                                  f"a linear layer of this model; the checkpoint is corrupt")
        try:
            _check_rank(rank, alpha)
        except ConfigError as exc:
            raise CheckpointError(f"config.json's \"lora\" entry for {name!r}: {exc}") from exc
        model.set_submodule(name, LoRALinear(
            layer.in_features, layer.out_features, rank, alpha, bias=layer.bias is not None,
            device=layer.weight.device, dtype=layer.weight.dtype))
    return model


def is_adapter_key(key: str) -> bool:
    """True for the state-dict keys of adapter matrices (what a LoRA checkpoint saves)."""
    return key.endswith(ADAPTER_SUFFIXES)


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its layer (in place; returns ``model``): plain
    ``nn.Linear`` layers again, every parameter trainable, as a fresh model."""
    for name, module in list(model.named_modules()):
        if isinstance(module, LoRALinear):
            model.set_submodule(name, module.merged())
    for p in model.parameters():
        p.requires_grad_(True)
    return model


def adapter_parameters(model: nn.Module) -> int:
    """The number of adapter parameters (what LoRA trains)."""
    return sum(p.numel() for n, p in model.named_parameters() if is_adapter_key(n))


__all__ = [
    "DEFAULT_TARGETS",
    "TARGETS",
    "LoRALinear",
    "adapter_parameters",
    "apply_lora",
    "apply_lora_structure",
    "is_adapter_key",
    "lora_structure",
    "merge_lora",
    "target_patterns",
]
