"""Which fast paths a model gets, decided once, and how they are applied from outside.

:func:`eligibility` is the one decision, shared by training and decoding. It reads the
modules' declared types and the config, never hooks or private registries:

- **ffn** (:class:`~tinylm.native.functions.FeedForwardFn`, any device): a
  :class:`~tinylm.core.model.FeedForward` whose ``up``/``down`` are plain ``nn.Linear`` and
  whose ``act`` is ``nn.GELU(approximate="tanh")``;
- **attention** (:class:`~tinylm.native.functions.CausalAttentionFn`, CPU with the
  library): a :class:`~tinylm.core.attention.MultiHeadAttention` with plain ``nn.Linear``
  projections and a head size the kernel takes (a multiple of 16);
- **block** (:class:`~tinylm.native.functions.BlockFn`, CPU with the library): a
  :class:`~tinylm.core.model.Block` whose norms are plain ``nn.LayerNorm`` and whose
  attention and FFN are both eligible as above; for an architecture variant instead
  (:func:`variant_block_reason`) :class:`~tinylm.native.variants.VariantBlockFn`:
  LayerNorm or RMSNorm, learned or rotary positions, QK-norm, GELU / ReLU² / SwiGLU,
  grouped-query attention, any biases. Without gradients (evaluation) either kind of
  block runs :func:`~tinylm.native.variants.block_inference`: the variants' forward
  with its temporaries in reused per-thread buffers, nothing kept for backward;
- **decode** (the fused decoding step of :mod:`tinylm.native.decoding`): a
  :class:`~tinylm.core.model.GPT` whose every block is eligible for **block** (any head size)
  with plain embeddings, final norm and LM head -- except that here each Linear layer
  (the LM head too) may also be a :class:`tinylm.layers.quantized.QuantizedLinear`, which the
  step runs with the int8 kernel of ``csrc/quant.c`` (except one with a per-group minimum:
  the registry's ``decoding_refusal``, for which the step steps aside), or a
  :class:`tinylm.layers.blocks.BlockLinear` (GGUF's Q4_0/Q4_1/Q8_0 blocks, ``csrc/blocks.c``);
- **decode_variant** (the fused step for the architecture variants, path
  ``"fused-variant"``): a :class:`~tinylm.core.model.GPT` of any layout ``ModelConfig``
  offers -- LayerNorm or RMSNorm, learned or rotary positions, GELU/ReLU² or SwiGLU MLPs,
  grouped-query attention, QK-norm -- whose pieces are the reference modules with plain
  (or quantized) Linear layers; GPT-2's own layout takes **decode** instead.

A replaced part (tinylm.layers.lowrank's LowRankLinear, a quantized Linear outside decoding,
another activation or norm) makes the paths that contain it step aside, as does any
config field this package does not know with a non-default value. A LoRA layer
(:class:`tinylm.layers.lora.LoRALinear`) is supported by the training paths (block,
attention, ffn): they multiply by its
:meth:`~tinylm.layers.lora.LoRALinear.effective_weight`, W + (α/r)·(A·B)ᵀ,
an autograd expression, so the gradients reach A and B; the decoding steps step aside.
Which replaced layers each kind of path takes is what :mod:`tinylm.layers.registry`
declares (:data:`TRAIN_LINEAR`, :data:`DECODE_LINEAR`, :func:`weight_of`); this module
names no kind.

:func:`accelerate` applies the training/forward paths by giving the eligible modules a
subclass of their own class (``NativeBlock``, ``NativeAttention``, ``NativeFeedForward``:
the technique of ``torch.nn.utils.parametrize``): parameters, state_dict keys,
``isinstance`` and DDP are unchanged, and :meth:`Plan.restore` gives the classes back.
At run time each accelerated forward still steps aside for what only a call can tell:
active dropout, other dtypes, CPU autocast, a context longer
than the kernel takes, ``tinylm.native.disabled()``, or a part replaced after the
decision. An accelerated block computes its sub-modules' math itself, so forward hooks
on those sub-modules do not fire (in training, nor in evaluation); :meth:`Plan.restore`
(or not accelerating) keeps every module call, as the reference model does.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from tinylm.core.attention import MultiHeadAttention, RMSNorm
from tinylm.core.config import ModelConfig
from tinylm.core.decoding import Decoder, KVCache, RaggedDecoder
from tinylm.core.model import GPT, Block, FeedForward, GatedFeedForward, ReLUSquared
from tinylm.layers.registry import (
    decoding_classes,
    decoding_refusal,
    training_classes,
    training_weight,
)
from tinylm.native import build, customops, decoding, gemm, ops, variants
from tinylm.native.functions import BlockFn, CausalAttentionFn, FeedForwardFn

log = logging.getLogger("tinylm.native")

# The config fields whose every value the fast paths implement (dropout is checked per
# call). A field added later (an architecture variant) must keep its default value.
KNOWN_FIELDS = frozenset({"vocab_size", "context_length", "n_layer", "n_head", "n_embd",
                          "head_dim", "dropout", "bias", "tie_embeddings", "norm_eps"})
# The architecture variants (docs/architectures.md): the GPT-2 paths implement GPT-2's
# layout of them (``ModelConfig.gpt2_layout`` decides it in one place), the variants'
# training block and decoding step the others.
LAYOUT_FIELDS = frozenset({"norm", "position", "rope_theta", "mlp", "ffn_hidden",
                           "n_kv_head", "qk_norm", "qkv_bias"})


@dataclass(frozen=True)
class BlockPaths:
    """The fast paths one block takes (each False: the reference path)."""

    block: bool
    attention: bool
    ffn: bool


@dataclass(frozen=True)
class Eligibility:
    """The decision for one model on one device; ``reasons`` say why paths step aside."""

    device: str
    native: bool  # the library is loaded, the parameters float32 on the CPU
    blocks: tuple[BlockPaths, ...]
    decode: bool
    reasons: tuple[str, ...]
    decode_variant: bool = False


# --- the declared types ---------------------------------------------------------------------


def declared(module: nn.Module) -> type:
    """The reference class of ``module`` (its own, unless :func:`accelerate` swapped it)."""
    return getattr(type(module), "reference_class", type(module))


# The Linear layers each kind of path computes, as tinylm.layers.registry declares them:
# training paths nn.Linear and the kinds with a training weight (LoRA, through weight_of);
# the fused decoding step nn.Linear and the kinds it decodes (int8: csrc/quant.c; GGUF
# blocks: csrc/blocks.c).
TRAIN_LINEAR = (nn.Linear, *training_classes())
DECODE_LINEAR = (nn.Linear, *decoding_classes())


def weight_of(layer: nn.Module) -> Tensor:
    """The dense (F, E) weight a training path multiplies by: an nn.Linear's own, or the
    one its kind declares (LoRA: W + (α/r)·(A·B)ᵀ, differentiable in A and B)."""
    return training_weight(layer)


def _linear_reason(name: str, layer: nn.Module, linear: tuple[type, ...]) -> str | None:
    if type(layer) not in linear:
        return f"{name} is a {type(layer).__name__}, not " + \
            " or ".join(t.__name__ for t in linear)
    refusal = decoding_refusal(layer) if linear is DECODE_LINEAR else None
    if refusal:  # a layer of a kind the decoding step takes, but not this one (registry)
        return f"{name} is a {type(layer).__name__} the decoding step cannot read: {refusal}"
    return None


def _ffn_reason(ffn: nn.Module, linear: tuple[type, ...] = TRAIN_LINEAR) -> str | None:
    if declared(ffn) is not FeedForward:
        return f"the FFN is a {type(ffn).__name__}"
    for name in ("up", "down"):
        reason = _linear_reason(f"ffn.{name}", getattr(ffn, name), linear)
        if reason:
            return reason
    act = ffn.act
    if type(act) is not nn.GELU or act.approximate != "tanh":
        return f"ffn.act is {act!r}, not nn.GELU(approximate='tanh')"
    return None


def _attention_reason(attn: nn.Module, linear: tuple[type, ...] = TRAIN_LINEAR
                      ) -> str | None:
    if declared(attn) is not MultiHeadAttention:
        return f"the attention is a {type(attn).__name__}"
    for name in ("qkv", "out"):
        reason = _linear_reason(f"attn.{name}", getattr(attn, name), linear)
        if reason:
            return reason
    return None


def _norm_reason(name: str, norm: nn.Module) -> str | None:
    if type(norm) is not nn.LayerNorm or len(norm.normalized_shape) != 1:
        return f"{name} is a {type(norm).__name__}, not a 1-D nn.LayerNorm"
    return None


def _block_reason(block: nn.Module, linear: tuple[type, ...] = TRAIN_LINEAR) -> str | None:
    if declared(block) is not Block:
        return f"the block is a {type(block).__name__}"
    return (_norm_reason("ln1", block.ln1) or _norm_reason("ln2", block.ln2)
            or _attention_reason(block.attn, linear) or _ffn_reason(block.ffn, linear))


def _config_reason(config: ModelConfig) -> str | None:
    if not config.gpt2_layout:
        return (f"the config is not GPT-2's layout (norm={config.norm}, position="
                f"{config.position}, mlp={config.mlp}, n_kv_head={config.n_kv_head}/"
                f"{config.n_head}, qk_norm={config.qk_norm}, qkv_bias={config.qkv_bias})")
    return _unknown_field_reason(config)


def _unknown_field_reason(config: ModelConfig) -> str | None:
    """A config field no fast path knows, with a value other than its default."""
    for field in dataclasses.fields(config):
        if field.name in KNOWN_FIELDS or field.name in LAYOUT_FIELDS:
            continue
        default = field.default if field.default is not dataclasses.MISSING else (
            field.default_factory() if field.default_factory is not dataclasses.MISSING
            else dataclasses.MISSING)
        if getattr(config, field.name) != default:
            return f"config.{field.name} = {getattr(config, field.name)!r} is not known here"
    return None


def variant_block_reason(block: nn.Module, linear: tuple[type, ...] = TRAIN_LINEAR
                         ) -> str | None:
    """Why the variants' fused steps cannot run ``block`` (None: they can): the training
    block (:class:`NativeVariantBlock`, ``linear`` = :data:`TRAIN_LINEAR`) and the
    decoding step (``linear`` = :data:`DECODE_LINEAR`) take the reference modules with
    those Linear layers, both norms of one kind, and the activations they implement."""
    if declared(block) is not Block or declared(block.attn) is not MultiHeadAttention:
        return f"the block is a {type(block).__name__}"
    attn, ffn = block.attn, block.ffn
    gated = declared(ffn) is GatedFeedForward
    if not gated and declared(ffn) is not FeedForward:
        return f"the FFN is a {type(ffn).__name__}"
    linears = {"attn.qkv": attn.qkv, "attn.out": attn.out, "ffn.up": ffn.up,
               "ffn.down": ffn.down, **({"ffn.gate": ffn.gate} if gated else {})}
    for name, layer in linears.items():
        reason = _linear_reason(name, layer, linear)
        if reason:
            return reason
    kinds = {type(block.ln1), type(block.ln2)}
    if kinds not in ({nn.LayerNorm}, {RMSNorm}) or (
            kinds == {nn.LayerNorm} and len(block.ln1.normalized_shape) != 1):
        return f"the norms are {type(block.ln1).__name__}/{type(block.ln2).__name__}"
    if not gated and not (type(ffn.act) is ReLUSquared or (
            type(ffn.act) is nn.GELU and ffn.act.approximate == "tanh")):
        return f"ffn.act is {ffn.act!r}"
    if attn.q_norm is not None and not (type(attn.q_norm) is RMSNorm
                                        and type(attn.k_norm) is RMSNorm):
        return "the QK-norm is not an RMSNorm"
    return None


def _variant_reason(model: GPT) -> str | None:
    """Why the variants' fused decoding step cannot run ``model`` (None: it can)."""
    unknown = _unknown_field_reason(model.config)
    if unknown:
        return unknown
    if type(model.tok_emb) is not nn.Embedding or (
            model.pos_emb is not None and type(model.pos_emb) is not nn.Embedding):
        return "the embeddings are not nn.Embedding"
    if type(model.final_norm) not in (nn.LayerNorm, RMSNorm):
        return f"final_norm is a {type(model.final_norm).__name__}"
    return _linear_reason("lm_head", model.lm_head, DECODE_LINEAR) or next(
        (f"block {i}: {r}" for i, b in enumerate(model.blocks)
         if (r := variant_block_reason(b, DECODE_LINEAR))), None)


def _model_reason(model: nn.Module) -> str | None:
    if type(model) is not GPT:
        return f"the model is a {type(model).__name__}, not a GPT"
    for name in ("tok_emb", "pos_emb"):
        if type(getattr(model, name)) is not nn.Embedding:
            return f"{name} is not an nn.Embedding"
    return _linear_reason("lm_head", model.lm_head, DECODE_LINEAR) or \
        _norm_reason("final_norm", model.final_norm)


def _block_paths(i: int, block: nn.Module, fits: bool, config_reason: str | None,
                 variant: bool, reasons: list[str]) -> BlockPaths:
    """The training/forward paths block ``i`` takes (``fits``: the native kernels are
    there and take its head size; ``variant``: an architecture variant, which only the
    variants' block takes); why the others step aside goes to ``reasons``."""
    if variant:
        whole = variant_block_reason(block)
        if whole:
            reasons.append(f"block {i}: {whole}; the variants' training block steps aside")
        return BlockPaths(block=fits and whole is None, attention=False, ffn=False)
    if config_reason is None and declared(block) is Block:
        ffn, attn, whole = _ffn_reason(block.ffn), _attention_reason(block.attn), \
            _block_reason(block)
    else:
        ffn = attn = whole = config_reason or f"block {i} is a {type(block).__name__}"
    for what, reason in (("ffn", ffn), ("attention", attn), ("block", whole)):
        if reason and config_reason is None:
            reasons.append(f"block {i}: {reason}; its {what} path steps aside")
    return BlockPaths(block=fits and whole is None, attention=fits and attn is None,
                      ffn=ffn is None)


def eligibility(model: nn.Module, device: torch.device | str | None = None,
                lib: ops.Library | None = None) -> Eligibility:
    """The fast paths ``model`` may take on ``device`` with the loaded ``lib`` (None: no
    native kernels): see the module docstring. Pure: changes nothing."""
    param = next(model.parameters(), None)
    device = torch.device(device) if device is not None else (
        param.device if param is not None else torch.device("cpu"))
    reasons: list[str] = []
    if not ops.enabled():
        reasons.append("the fast paths are off (TINYLM_NATIVE=0 or native.disabled())")
        return Eligibility(str(device), False, (), False, tuple(reasons))
    if not isinstance(model, GPT):
        reasons.append(f"the model is a {type(model).__name__}, not a GPT")
        return Eligibility(str(device), False, (), False, tuple(reasons))
    native = (lib is not None and device.type == "cpu"
              and all(p.dtype == torch.float32 for p in model.parameters()))
    if not native:
        reasons.append("no native kernels for this device/dtype" if lib is not None
                       else "the native library is not loaded")
    config_reason = _config_reason(model.config)
    unknown = _unknown_field_reason(model.config)
    if config_reason:
        reasons.append(config_reason + (": every fast path steps aside" if unknown else
                                        ": the variants' training block and decoding step "
                                        "only"))
    fits = native and ops.attention_fits(1, model.config.n_head, model.config.head_dim)
    variant = config_reason is not None and unknown is None  # an architecture variant
    blocks = [_block_paths(i, block, fits, config_reason, variant, reasons)
              for i, block in enumerate(model.blocks)]
    model_reason = _model_reason(model)
    if model_reason:
        reasons.append(model_reason + "; the fused decoding step steps aside")
    block_decode = next((f"block {i}: {r}" for i, b in enumerate(model.blocks)
                         if (r := _block_reason(b, DECODE_LINEAR))), None)
    if block_decode and config_reason is None:
        reasons.append(block_decode + "; the fused decoding step steps aside")
    decode = native and config_reason is None and model_reason is None and not block_decode
    variant = None if model.config.gpt2_layout else _variant_reason(model)
    if variant:
        reasons.append(variant + "; the variants' fused decoding step steps aside")
    return Eligibility(str(device), native, tuple(blocks), decode, tuple(reasons),
                       decode_variant=native and not model.config.gpt2_layout
                       and variant is None)


# --- the accelerated modules ----------------------------------------------------------------


def _cpu_float32(x: Tensor) -> bool:
    return x.dtype == torch.float32 and x.device.type == "cpu" \
        and not torch.is_autocast_enabled("cpu")


def _same(now: tuple[nn.Module, ...], then: tuple[nn.Module, ...]) -> bool:
    return all(a is b for a, b in zip(now, then, strict=True))


class NativeFeedForward(FeedForward):
    """:class:`FeedForward` whose forward is one :class:`FeedForwardFn` (in evaluation too:
    its native GELU pass is faster than torch's on the CPU)."""

    reference_class = FeedForward

    def _parts(self) -> tuple[nn.Module, ...]:
        return self.up, self.act, self.down

    def forward(self, x: Tensor) -> Tensor:
        if not (ops.enabled() and _same(self._parts(), self._tinylm_parts)):
            return super().forward(x)
        lib = ops.loaded() if _cpu_float32(x) else None
        if torch.compiler.is_compiling():  # the custom op; elsewhere the reference, compiled
            if lib is None:
                return super().forward(x)
            y = customops.ffn(x, weight_of(self.up), self.up.bias, weight_of(self.down),
                              self.down.bias)[0]
        else:
            y = FeedForwardFn.apply(x, weight_of(self.up), self.up.bias,
                                    weight_of(self.down), self.down.bias, lib)  # (B, C, E)
        return self.drop(y) if self.drop.training and self.drop.p > 0 else y


class NativeAttention(MultiHeadAttention):
    """:class:`MultiHeadAttention` whose cache-free forward runs the native kernels."""

    reference_class = MultiHeadAttention

    def _parts(self) -> tuple[nn.Module, ...]:
        return self.qkv, self.out

    def native_lib(self, x: Tensor) -> ops.Library | None:
        """The library, where this call can run natively (else None)."""
        lib = ops.loaded()
        if lib is None or not _cpu_float32(x) or (self.training and self.dropout > 0) \
                or self.qkv.weight.dtype != torch.float32 \
                or not ops.attention_fits(x.shape[1], self.n_head, self.head_dim) \
                or not _same(self._parts(), self._tinylm_parts):
            return None
        return lib

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0, *,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        lib = self.native_lib(x) if cache is None and not return_weights else None
        if lib is None:
            return super().forward(x, cache, layer, return_weights=return_weights)
        if torch.compiler.is_compiling():  # inside a graph: the custom op
            return customops.attention(x, weight_of(self.qkv), self.qkv.bias,
                                       weight_of(self.out), self.out.bias, self.n_head)[0]
        return CausalAttentionFn.apply(x, weight_of(self.qkv), self.qkv.bias,
                                       weight_of(self.out), self.out.bias, self.n_head, lib)


class NativeBlock(Block):
    """:class:`Block` whose training forward is one :class:`BlockFn` (CPU); without
    gradients (evaluation) :func:`tinylm.native.variants.block_inference` runs it, the
    variants' block on GPT-2's layout, its temporaries in reused buffers."""

    reference_class = Block

    def _parts(self) -> tuple[nn.Module, ...]:
        a, f = self.attn, self.ffn
        return self.ln1, a, a.qkv, a.out, self.ln2, f, f.up, f.act, f.down

    def _fused_lib(self, x: Tensor) -> ops.Library | None:
        lib = ops.loaded()
        drops = (self.drop, self.ffn.drop)
        if lib is None or not _cpu_float32(x) \
                or any(d.training and d.p > 0 for d in drops) \
                or (self.attn.training and self.attn.dropout > 0) \
                or not ops.attention_fits(x.shape[1], self.attn.n_head, self.attn.head_dim) \
                or not _same(self._parts(), self._tinylm_parts):
            return None
        return lib

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        lib = self._fused_lib(x) if cache is None and not return_weights else None
        if lib is None:
            return super().forward(x, cache, layer, return_weights)
        if not torch.is_grad_enabled():
            layout, tensors = _variant_args(self, x)
            if torch.compiler.is_compiling():  # inside a graph: the custom op
                return customops.block_inference(x, *customops.layout_args(layout),
                                                 customops.block_tensors(x, tensors))
            return variants.block_inference(lib, layout, x, *tensors)
        return self._fused(x, lib)

    def _fused(self, x: Tensor, lib: ops.Library) -> Tensor:
        """The block as one autograd step on ``lib``."""
        attn, ffn, ln1, ln2 = self.attn, self.ffn, self.ln1, self.ln2
        if torch.compiler.is_compiling():  # inside a graph: the custom op
            return customops.block(
                x, attn.n_head, ln1.eps, ln2.eps, ln1.weight, ln1.bias, weight_of(attn.qkv),
                attn.qkv.bias, weight_of(attn.out), attn.out.bias, ln2.weight, ln2.bias,
                weight_of(ffn.up), ffn.up.bias, weight_of(ffn.down), ffn.down.bias)[0]
        return BlockFn.apply(  # LayerNorm weight/bias may be None
            x, attn.n_head, ln1.eps, ln2.eps, ln1.weight, ln1.bias, weight_of(attn.qkv),
            attn.qkv.bias, weight_of(attn.out), attn.out.bias, ln2.weight, ln2.bias,
            weight_of(ffn.up), ffn.up.bias, weight_of(ffn.down), ffn.down.bias, lib)


class NativeVariantBlock(NativeBlock):
    """:class:`Block` of an architecture variant whose training forward is one
    :class:`~tinylm.native.variants.VariantBlockFn` (CPU): :class:`NativeBlock`'s
    dispatch with its own parts and step."""

    reference_class = Block

    def _parts(self) -> tuple[nn.Module | None, ...]:
        a, f = self.attn, self.ffn
        return (self.ln1, a, a.qkv, a.out, a.q_norm, a.k_norm, self.ln2, f, f.up, f.down,
                getattr(f, "gate", None), getattr(f, "act", None))

    def _fused(self, x: Tensor, lib: ops.Library) -> Tensor:
        layout, tensors = _variant_args(self, x)
        if torch.compiler.is_compiling():  # inside a graph: the custom op
            return customops.variant_block(x, *customops.layout_args(layout),
                                           customops.block_tensors(x, tensors))[0]
        return variants.VariantBlockFn.apply(x, layout, lib, *tensors)


def _variant_args(block: Block, x: Tensor) -> tuple[variants.Layout, tuple]:
    """(layout, tensors in variants.TENSORS order) of ``block`` (any layout the variants'
    block takes, GPT-2's too) for VariantBlockFn and block_inference on input x."""
    attn, ffn, ln1, ln2 = block.attn, block.ffn, block.ln1, block.ln2
    # inside a graph the tables are computed there (dynamo ignores the lru_cache)
    tables = variants.rope_tables.__wrapped__ if torch.compiler.is_compiling() \
        else variants.rope_tables
    cos, sin = tables(x.shape[1], attn.head_dim, attn.rope_theta,
                      x.device) if attn.rope_theta is not None else (None, None)
    gate = getattr(ffn, "gate", None)
    mlp = "swiglu" if gate is not None else (
        "relu2" if type(ffn.act) is ReLUSquared else "gelu")
    norm = "rmsnorm" if type(ln1) is RMSNorm else "layernorm"
    layout = variants.Layout(attn.n_head, attn.n_kv_head, norm, mlp, ln1.eps, ln2.eps,
                             attn.q_norm.eps if attn.q_norm is not None else 0.0)
    qn, kn = attn.q_norm, attn.k_norm
    return layout, (ln1.weight, getattr(ln1, "bias", None), weight_of(attn.qkv),
                    attn.qkv.bias, qn.weight if qn is not None else None,
                    kn.weight if kn is not None else None, weight_of(attn.out),
                    attn.out.bias, ln2.weight, getattr(ln2, "bias", None),
                    weight_of(gate) if gate is not None else None,
                    gate.bias if gate is not None else None, weight_of(ffn.up), ffn.up.bias,
                    weight_of(ffn.down), ffn.down.bias, cos, sin)


# --- the plan -------------------------------------------------------------------------------


class Plan:
    """The fast paths chosen for one model on one device (:func:`plan`), applied by
    :meth:`apply` and undone by :meth:`restore`; as a context manager it undoes on exit
    what it applied. :meth:`decoder` makes the decoding plan, which changes nothing."""

    def __init__(self, model: nn.Module, decision: Eligibility, lib: ops.Library | None):
        self.model, self.eligibility, self.lib = model, decision, lib
        self._swapped: list[tuple[nn.Module, type]] = []

    @property
    def paths(self) -> frozenset[str]:
        """The fast paths in this plan: a subset of {"block", "attention", "ffn",
        "decode"}."""
        e = self.eligibility
        names = {name for b in e.blocks for name in ("block", "attention", "ffn")
                 if getattr(b, name)}
        return frozenset(names | ({"decode"} if e.decode or e.decode_variant else set()))

    def _swap(self, module: nn.Module, cls: type) -> None:
        parts = cls._parts(module)
        if type(module) is not cls:
            self._swapped.append((module, type(module)))
            module.__class__ = cls
        module._tinylm_parts = parts

    def apply(self, only: Iterable[str] | None = None) -> Plan:
        """Give each eligible module its accelerated class (idempotent); ``only`` limits
        this to some of "block", "attention", "ffn" (e.g. to measure or test one)."""
        want = {"block", "attention", "ffn"} if only is None else set(only)
        for block, paths in zip(self.model.blocks if self.eligibility.blocks else (),
                                self.eligibility.blocks, strict=True):
            if paths.ffn and "ffn" in want:
                self._swap(block.ffn, NativeFeedForward)
            if paths.attention and "attention" in want:
                self._swap(block.attn, NativeAttention)
            if paths.block and "block" in want:
                self._swap(block, NativeBlock if self.model.config.gpt2_layout
                           else NativeVariantBlock)
        return self

    def restore(self) -> None:
        """Give back the classes this plan swapped: the model runs its reference path."""
        for module, cls in reversed(self._swapped):
            module.__class__ = cls
            module.__dict__.pop("_tinylm_parts", None)
        self._swapped.clear()

    def decoder(self, batch_size: int) -> Decoder:
        """The decoding plan for ``batch_size`` rows: the fused native step where the
        decision allows, else the model's own forward through a (native, on CPU) cache."""
        if self.eligibility.decode and ops.enabled() and self.lib is not None:
            return decoding.FusedDecoder(self.model, batch_size, self.lib)
        if self.eligibility.decode_variant and ops.enabled() and self.lib is not None:
            return decoding.VariantDecoder(self.model, batch_size, self.lib)
        if self.eligibility.native and ops.enabled() and self.lib is not None:
            return decoding.NativeCacheDecoder(self.model, batch_size, self.lib)
        return Decoder(self.model, batch_size)

    @property
    def compiled_path(self) -> str:
        """What ``torch.compile`` of this plan's model puts in its graph: "native custom
        ops" (CPU: the accelerated modules call tinylm.native.customops) or "reference"
        (elsewhere, e.g. CUDA: the accelerated modules run their reference forward
        inside a graph, which inductor fuses)."""
        native = self.lib is not None and self.eligibility.native and \
            bool(self.paths & {"block", "attention", "ffn"})
        return "native custom ops" if native else "reference"

    def compile(self, module: nn.Module) -> nn.Module:
        """``torch.compile(module)`` (this plan's model, or a wrapper of it such as DDP):
        the one place a compiled model is made. Inductor's artefacts go to tinylm's
        private cache folder (:func:`use_compile_cache`), reused by later runs."""
        use_compile_cache()
        return torch.compile(module)

    def ragged_decoder(self, batch_size: int) -> RaggedDecoder:
        """The continuous-batching step for up to ``batch_size`` rows at their own
        positions: the fused native step (or the variants') where the decision allows,
        else the model's own forward over a RaggedKVCache, its ``reason`` saying why."""
        on = ops.enabled() and self.lib is not None
        if on and (self.eligibility.decode or self.eligibility.decode_variant):
            return decoding.FusedRaggedDecoder(self.model, batch_size, self.lib,
                                               variant=not self.eligibility.decode)
        reason = "; ".join(self.eligibility.reasons) or \
            "the fused decoding step does not take this model"
        return RaggedDecoder(self.model, batch_size, reason)

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def use_compile_cache() -> str | None:
    """Point inductor's caches (its FX graph cache, on by default, and its generated code)
    at ``$XDG_CACHE_HOME/tinylm/inductor`` (private to this user, as the kernels' folder)
    unless ``TORCHINDUCTOR_CACHE_DIR`` names another folder than torch's default, a
    folder under /tmp shared by every program of the user (torch writes it into the
    variable on first use).
    Returns the folder in use (None: torch's default, where the private one cannot be
    made)."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # torch writes its default there
    if chosen and not _torch_default_cache(chosen):
        return chosen
    try:
        folder = build.private_folder(build.compile_cache_root())
    except build.NativeUnavailable as e:  # UnsafeCache included
        log.warning("torch.compile's cache stays in torch's default folder: %s", e)
        return None
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    return str(folder)


def _torch_default_cache(folder: str) -> bool:
    """Whether ``folder`` is torch's default inductor cache (``torchinductor_<user>`` in
    the temporary folder), which torch writes into TORCHINDUCTOR_CACHE_DIR on first use
    (importing torch._inductor to ask it would cost seconds)."""
    path = os.path.abspath(folder)
    return os.path.dirname(path) == os.path.abspath(tempfile.gettempdir()) and \
        os.path.basename(path).startswith("torchinductor_")


def plan(model: nn.Module, device: torch.device | str | None = None) -> Plan:
    """Decide the fast paths of ``model`` on ``device`` (default: its parameters'); on
    the CPU this builds and loads the native library if that has not happened yet."""
    param = next(model.parameters(), None)
    dev = torch.device(device) if device is not None else (
        param.device if param is not None else torch.device("cpu"))
    lib = ops.load() if dev.type == "cpu" and ops.enabled() else None
    decision = eligibility(model, dev, lib)
    for reason in decision.reasons:
        log.debug("native: %s", reason)
    if lib is not None:  # a bad TINYLM_GEMM is refused here, before any step runs
        log.debug("native: large products on %s", gemm.selected())
    return Plan(model, decision, lib)


def accelerate(model: nn.Module, device: torch.device | str | None = None) -> Plan:
    """Choose the fast paths of ``model`` on ``device`` and apply them to its modules
    (see the module docstring); returns the :class:`Plan`."""
    return plan(model, device).apply()
