"""Weights stored as GGUF's blocks: Q4_0 and Q4_1 (two weights per byte) and Q8_0, the
replaced Linear layer :class:`BlockLinear`.

A row of a weight W (O, I) in ``nn.Linear``'s orientation is cut into blocks of 32
consecutive input features (the last block zero-padded when 32 does not divide I; GGUF
itself has no such rows). Each block is stored as llama.cpp stores it, byte for byte:

==== ===== ====================================== ===================================
type bytes layout                                 weight of code q
==== ===== ====================================== ===================================
Q4_0 18    fp16 d, 16 bytes of nibbles             w = d·(q − 8), q in [0, 15]
Q4_1 20    fp16 d, fp16 m, 16 bytes of nibbles     w = d·q + m,   q in [0, 15]
Q8_0 34    fp16 d, 32 int8                         w = d·q,       q in [−128, 127]
==== ===== ====================================== ===================================

where byte j of a 4-bit block holds code j in its low nibble and code 16 + j in its high
one. An imported GGUF tensor of these types is the layer's buffer as it is (no round
trip through float32, :mod:`tinylm.io.gguf`); ``tinylm quantize --bits 4 --group-size
32`` writes the same bytes as the gguf package's (and llama.cpp's reference)
quantization (:func:`quantize_blocks`). :func:`dequantize_blocks` is GGUF's own
arithmetic in float32 (the product rounded before the minimum is added), so the
layer's weight equals ``gguf.quants.dequantize`` of its bytes bit for bit
(tests/test_blocks.py).

:class:`BlockLinear` is the reference form (dequantize, then ``F.linear``). The fused
decoding step reads its bytes with the native kernel of ``csrc/blocks.c``, which
quantizes the activations per block of 32 as llama.cpp does (:func:`quantize_activations`)
and takes integer dot products; :func:`kernel_product` is that arithmetic in torch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.errors import ConfigError
from tinylm.layers.dense import DequantizingLinear, replace_named_layers

QK = 32  # weights per block
#: type name -> (GGML type id, bytes per block)
TYPES: dict[str, tuple[int, int]] = {"Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34)}


def check_type(block_type: Any) -> str:
    """``block_type`` if it is one of :data:`TYPES`, else a ConfigError."""
    if block_type not in TYPES:
        raise ConfigError(f"block type must be one of {', '.join(TYPES)}, got {block_type!r}")
    return block_type


def n_blocks(in_features: int) -> int:
    return -(-in_features // QK)


# --- the arithmetic (gguf.quants', in torch) ------------------------------------------------


def _half_bytes(v: Tensor) -> Tensor:
    """(..., 1) float32 -> (..., 2) uint8: the fp16 (round to nearest even) of each value."""
    return v.to(torch.float16).contiguous().view(torch.uint8)


def _nibbles(q: Tensor) -> Tensor:
    """(n, 32) codes in [0, 15] -> (n, 16) bytes: code j low, code 16 + j high."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def _round_half_away(x: Tensor) -> Tensor:
    """gguf.quants.np_roundf: |x| rounded half up, with x's sign (as C's roundf)."""
    a = x.abs()
    fl = torch.floor(a)
    return torch.sign(x) * (fl + torch.floor(2 * (a - fl)))


def quantize_blocks(W: Tensor, block_type: str) -> Tensor:
    """W (O, I) -> its blocks (O, ceil(I/32)·bytes) uint8, the bytes gguf.quants.quantize
    (llama.cpp's reference quantizer) writes for W zero-padded to a multiple of 32."""
    check_type(block_type)
    if W.dim() != 2:
        raise ValueError(f"quantize_blocks needs a 2-D weight, got shape {tuple(W.shape)}")
    O, I = W.shape
    nb = n_blocks(I)
    x = F.pad(W.detach().to(torch.float32), (0, nb * QK - I)).reshape(O * nb, QK)
    zero = torch.zeros((), dtype=torch.float32)
    if block_type == "Q4_0":
        top = torch.gather(x, 1, x.abs().argmax(1, keepdim=True))  # signed, largest |x|
        d = top / -8
        inv = torch.where(d == 0, zero, 1 / d)
        q = torch.trunc(x * inv + 8.5).clamp(0, 15)
        parts = [_half_bytes(d), _nibbles(q)]
    elif block_type == "Q4_1":
        hi, lo = x.amax(1, keepdim=True), x.amin(1, keepdim=True)
        d = (hi - lo) / 15
        inv = torch.where(d == 0, zero, 1 / d)
        q = torch.trunc((x - lo) * inv + 0.5).clamp(0, 15)
        parts = [_half_bytes(d), _half_bytes(lo), _nibbles(q)]
    else:
        d = x.abs().amax(1, keepdim=True) / 127
        inv = torch.where(d == 0, zero, 1 / d)
        q = _round_half_away(x * inv).to(torch.int8).view(torch.uint8)
        parts = [_half_bytes(d), q]
    return torch.cat(parts, 1).reshape(O, nb * TYPES[block_type][1]).contiguous()


def block_parts(blocks: Tensor, block_type: str) -> tuple[Tensor, Tensor, Tensor | None]:
    """(codes (O, nb, 32) float32 as stored: nibbles 0..15 or int8, d (O, nb) float32,
    m (O, nb) float32 or None) of a layer's bytes."""
    bs = TYPES[block_type][1]
    O = blocks.shape[0]
    b = blocks.reshape(O, -1, bs)

    def half(at: int) -> Tensor:
        return b[:, :, at:at + 2].contiguous().view(torch.float16).to(torch.float32)[..., 0]

    if block_type == "Q8_0":
        codes = b[:, :, 2:].contiguous().view(torch.int8).to(torch.float32)
        return codes, half(0), None
    raw = b[:, :, 4 if block_type == "Q4_1" else 2:]
    codes = torch.cat([raw & 0x0F, raw >> 4], 2).to(torch.float32)
    return codes, half(0), half(2) if block_type == "Q4_1" else None


def dequantize_blocks(blocks: Tensor, block_type: str, in_features: int) -> Tensor:
    """W (O, I) float32 of the blocks, as gguf.quants.dequantize computes it."""
    codes, d, m = block_parts(blocks, block_type)
    if block_type == "Q4_0":
        codes = codes - 8
    w = d[..., None] * codes
    if m is not None:
        w = w + m[..., None]
    return w.reshape(blocks.shape[0], -1)[:, :in_features]


# --- the native kernel's arithmetic (csrc/blocks.c) -------------------------------------------


def quantize_activations(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (M, I) -> (qx (M, nb, 32) integers as float32, dx (M, nb)): each block of 32
    (zeros past I) with largest magnitude a gets dx = a / 127 and qx = round(x / dx),
    half to even (llama.cpp's Q8 activations; |x − dx·qx| <= dx / 2)."""
    M, I = x.shape
    nb = n_blocks(I)
    v = F.pad(x.detach().to(torch.float32), (0, nb * QK - I)).reshape(M, nb, QK)
    d = v.abs().amax(2) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros((), dtype=torch.float32))
    return torch.round(v * inv[..., None]), d


def kernel_product(x: Tensor, blocks: Tensor, block_type: str) -> Tensor:
    """x·Wᵀ (M, O) float32 as the native kernel computes it: activations quantized by
    :func:`quantize_activations`, exact integer dot products per block, each scaled by
    d·dx (plus m·dx·Σqx for Q4_1), summed in float64."""
    qx, dx = quantize_activations(x)
    codes, d, m = block_parts(blocks, block_type)
    if block_type == "Q4_0":
        codes = codes - 8
    dots = torch.einsum("mbj,obj->mob", qx.double(), codes.double())  # exact integers
    y = (dots * d.double()[None] * dx.double()[:, None]).sum(2)
    if m is not None:
        y = y + (m.double()[None] * (dx.double() * qx.double().sum(2))[:, None]).sum(2)
    return y.to(torch.float32)


# --- the module ---------------------------------------------------------------------------------


class BlockLinear(DequantizingLinear):
    """y = x·Wᵀ + b with W stored as GGUF blocks of ``block_type`` (Q4_0, Q4_1, Q8_0).

    ``blocks`` (O, ceil(I/32)·bytes) uint8 is a buffer (not trained), the bytes of a GGUF
    tensor's rows; ``bias`` (O,) stays a float32 parameter. Build one with
    :meth:`from_linear`, or construct it empty and load a state dict into it."""

    def __init__(self, in_features: int, out_features: int, block_type: str = "Q4_0",
                 bias: bool = True, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.block_type = check_type(block_type)
        self.in_features, self.out_features = in_features, out_features
        width = n_blocks(in_features) * TYPES[block_type][1]
        self.register_buffer("blocks", torch.zeros(out_features, width, dtype=torch.uint8,
                                                   device=device))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, layer: nn.Linear, block_type: str = "Q4_0") -> BlockLinear:
        """The block-quantized replacement of a dense layer (its bias copied as it is)."""
        W = layer.weight.detach()
        new = cls(layer.in_features, layer.out_features, block_type,
                  bias=layer.bias is not None, device=W.device)
        new.blocks.copy_(quantize_blocks(W, block_type))
        if layer.bias is not None:
            with torch.no_grad():
                new.bias.copy_(layer.bias.to(torch.float32))
        return new

    @property
    def weight(self) -> Tensor:
        """The dequantized weight (O, I), bit for bit gguf.quants.dequantize's."""
        return dequantize_blocks(self.blocks, self.block_type, self.in_features)

    @property
    def quantized_weights(self) -> int:
        """The weights the blocks hold (O·I; the padding of a last short block excluded)."""
        return self.out_features * self.in_features

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"block_type={self.block_type}, bias={self.bias is not None}")


# --- model structure (tinylm.layers.registry: config.json's "blocks") ---------------------------


def structure_of(model: nn.Module) -> dict[str, dict[str, Any]]:
    """{module name: {"type": "Q4_0"}} of every BlockLinear."""
    return {name: {"type": m.block_type} for name, m in model.named_modules()
            if isinstance(m, BlockLinear)}


def apply_structure(model: nn.Module, layers: Any) -> nn.Module:
    """Replace the named Linear layers by empty BlockLinear ones (config.json's "blocks"
    entry); loading the state dict then fills the blocks and the bias."""
    def build(layer: nn.Module, name: str, scheme: Any) -> BlockLinear:
        if not isinstance(scheme, dict):
            raise ConfigError(f"a block scheme must be an object, got {scheme!r}")
        return BlockLinear(layer.in_features, layer.out_features, scheme.get("type"),
                           bias=layer.bias is not None)
    return replace_named_layers(model, layers, "blocks", BlockLinear, build)
