"""The replaced-layer kinds, each declared once: what the rest of tinylm asks about them.

A *replaced layer* stands in for an ``nn.Linear`` of the reference model. Each kind
says, in one :class:`LayerKind` row of :data:`KINDS`:

- its ``section``: the name of its entry in config.json (``"lowrank"``, ``"quantize"``,
  ``"gguf_blocks"``, ``"lora"``), which :func:`structure_of` writes and
  :func:`apply_structure` reads, in the order of :data:`KINDS` (the checkpoint format is
  unchanged);
- its module ``classes`` and how one is ``build``-t from an ``nn.Linear``;
- ``describe(model)``: its config.json entry for a model (empty when it has none), and
  ``rebuild(model, entry)``: the empty layers put back before the state dict loads;
- ``dense(layer)``: the layer made a plain ``nn.Linear`` again (the same function: the
  product of the factors, the dequantized weight, the merged adapter), and whether an
  export (``tinylm convert --to-hf``) writes it so or refuses (``export_refusal``);
- which fast paths of :mod:`tinylm.native` take it: ``training_weight`` (the dense
  weight the training/forward paths multiply by; None: they step aside) and
  ``decoding`` (how the fused decoding step reads it: ``"int8"``, the int8 kernel of
  csrc/quant.c, or ``"blocks"``, GGUF's blocks read as stored by csrc/blocks.c; None: it
  steps aside), with ``decoding_refusal(layer)`` naming a layer of the kind that step still
  cannot read (an int8 layer with a per-group minimum: it steps aside for that one).

A new kind (say 4-bit GGUF blocks) is one module with its layer and one row here;
``io/checkpoint*.py``, ``io/hf.py``, ``native/plan.py``, ``native/decoding.py`` and the
training loop ask these functions and name no kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from tinylm.layers import blocks, lora, lowrank, quantized
from tinylm.layers.selection import select_layers


@dataclass(frozen=True)
class LayerKind:
    """One kind of replaced layer (see the module docstring for each field)."""

    section: str
    classes: tuple[type[nn.Module], ...]
    build: Callable[..., nn.Module]
    describe: Callable[[nn.Module], dict[str, Any]]
    rebuild: Callable[[nn.Module, Any], nn.Module]
    dense: Callable[[nn.Module], nn.Linear]
    training_weight: Callable[[nn.Module], Tensor] | None = None
    decoding: str | None = None
    decoding_refusal: Callable[[nn.Module], str | None] | None = None
    export_refusal: str | None = None  # {architecture} is filled in

    def present_in(self, model: nn.Module) -> bool:
        """True when ``model`` holds a layer of this kind."""
        return any(isinstance(m, self.classes) for m in model.modules())


LOWRANK = LayerKind(
    section="lowrank", classes=(lowrank.LowRankLinear,),
    build=lowrank.LowRankLinear.from_linear, describe=lowrank.structure_of,
    rebuild=lowrank.apply_structure, dense=lowrank.LowRankLinear.to_linear,
    export_refusal="a compressed (low-rank) model has no {architecture} equivalent; export "
                   "the model before 'tinylm compress'")
QUANTIZED = LayerKind(
    section="quantize", classes=(quantized.QuantizedLinear,),
    build=quantized.QuantizedLinear.from_linear, describe=quantized.structure_of,
    rebuild=quantized.apply_structure, dense=quantized.QuantizedLinear.to_linear,
    decoding="int8", decoding_refusal=quantized.decoding_refusal)
BLOCKS = LayerKind(
    section="gguf_blocks", classes=(blocks.BlockLinear,),
    build=blocks.BlockLinear.from_linear, describe=blocks.structure_of,
    rebuild=blocks.apply_structure, dense=blocks.BlockLinear.to_linear, decoding="blocks")
LORA = LayerKind(
    section="lora", classes=(lora.LoRALinear,),
    build=lora.LoRALinear.from_linear, describe=lora.lora_structure,
    rebuild=lora.apply_lora_structure, dense=lora.LoRALinear.merged,
    training_weight=lora.LoRALinear.effective_weight)

#: Every kind, in the order config.json's sections are written and rebuilt.
KINDS: tuple[LayerKind, ...] = (LOWRANK, QUANTIZED, BLOCKS, LORA)
#: config.json's sections that describe a model's structure (not free-form metadata).
SECTIONS: tuple[str, ...] = tuple(k.section for k in KINDS)

_BY_CLASS = {cls: kind for kind in KINDS for cls in kind.classes}


def kind_of(module: nn.Module) -> LayerKind | None:
    """The kind of a replaced layer (by its exact type); None for anything else."""
    return _BY_CLASS.get(type(module))


def structure_of(model: nn.Module) -> dict[str, Any]:
    """config.json's structure sections for ``model``: {section: entry} for each kind it
    holds (``{"lowrank": {"blocks.0.attn.qkv": 24}}``); empty for a plain model."""
    return {kind.section: entry for kind in KINDS if (entry := kind.describe(model))}


def apply_structure(model: nn.Module, config: dict[str, Any]) -> nn.Module:
    """Put back the replaced layers config.json describes (each non-empty section, in
    the order of :data:`KINDS`), empty, before the state dict is loaded; in place."""
    for kind in KINDS:
        entry = config.get(kind.section)
        if entry:
            kind.rebuild(model, entry)
    return model


def densified(model: nn.Module, kinds: Iterable[LayerKind] = KINDS) -> nn.Module:
    """``model`` with every layer of ``kinds`` made a plain ``nn.Linear`` (in place)."""
    kinds = tuple(kinds)
    for name, module in list(model.named_modules()):
        kind = kind_of(module)
        if kind is not None and kind in kinds:
            model.set_submodule(name, kind.dense(module))
    return model


def training_classes() -> tuple[type[nn.Module], ...]:
    """The replaced-layer classes the native training/forward paths take."""
    return tuple(c for k in KINDS if k.training_weight is not None for c in k.classes)


def decoding_classes() -> tuple[type[nn.Module], ...]:
    """The replaced-layer classes the fused decoding step takes."""
    return tuple(c for k in KINDS if k.decoding is not None for c in k.classes)


def training_weight(layer: nn.Module) -> Tensor:
    """The dense (F, E) weight a training path multiplies ``layer`` by: a plain layer's
    own, or what its kind declares (LoRA: W + (α/r)·(A·B)ᵀ, differentiable in A and B)."""
    kind = _BY_CLASS.get(type(layer))
    if kind is None or kind.training_weight is None:
        return layer.weight
    return kind.training_weight(layer)


def decoding_of(layer: nn.Module) -> str | None:
    """How the fused decoding step reads ``layer`` ("int8", "blocks"), None for a plain layer, a
    kind it does not take, or a layer its kind's ``decoding_refusal`` names."""
    kind = _BY_CLASS.get(type(layer))
    if kind is None or decoding_refusal(layer) is not None:
        return None
    return kind.decoding


def decoding_refusal(layer: nn.Module) -> str | None:
    """Why the fused decoding step cannot read ``layer``, a layer of a kind it takes
    (None: it can, or the layer is not of such a kind)."""
    kind = _BY_CLASS.get(type(layer))
    if kind is None or kind.decoding is None or kind.decoding_refusal is None:
        return None
    return kind.decoding_refusal(layer)


__all__ = ["BLOCKS", "KINDS", "LORA", "LOWRANK", "QUANTIZED", "SECTIONS", "LayerKind",
           "apply_structure", "decoding_classes", "decoding_of", "decoding_refusal", "densified",
           "kind_of", "select_layers", "structure_of", "training_classes", "training_weight"]
