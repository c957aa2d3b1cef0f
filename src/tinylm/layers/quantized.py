"""Weight-only int8 quantization: the replaced Linear layer (``tinylm quantize`` is
:mod:`tinylm.commands.quantize`).

The scheme (symmetric, per output channel or per group of G input features): for a
weight W (O, I) in ``nn.Linear``'s orientation, each row o is cut into groups of G
consecutive input features (G = I: one group per row, "per channel"). A group g with
largest magnitude m = max|W[o, g]| gets the scale

    s[o, g] = m / qmax,     qmax = 2^(bits-1) - 1   (127 for 8 bits)

and its integers q = round(W / s), clamped to [-qmax, qmax] and stored as int8. The
layer computes y = x·(q·s)ᵀ + b: activations stay float32, only the weights are
approximated. Rounding to the nearest step makes every element's error at most half a
step, |W - q·s| <= s/2, so the error of a group is bounded by its own largest weight
(m / 254 for 8 bits). An all-zero group gets scale 1 (q = 0, exact).

A layer may also carry a per-group ``minimum`` (the asymmetric form w = q·s + m with
unsigned codes q in [0, 2^bits - 1], GGUF's Q4_1 and Q5_1 blocks, kept by
:mod:`tinylm.io.gguf`): the reference layer adds it after the product; the int8
decoding kernel does not, so the fused decoding step steps aside for such layers
(:func:`decoding_refusal`, what the registry declares). ``tinylm quantize`` itself
writes the symmetric form only.

:class:`QuantizedLinear` is the reference form (dequantize, then ``F.linear``), as
:class:`tinylm.layers.lowrank.LowRankLinear` is for factorised layers. Its int8 integers and
float32 scales are buffers (``<name>.qweight``, ``<name>.scale``) that go through the
normal checkpoint path; config.json records the scheme (``"quantize"``) so the loader
rebuilds the layers without flags. The training and forward fast paths of
:mod:`tinylm.native` step aside for it (its type is not ``nn.Linear``); the fused
decoding step reads its integers and scales with the int8 kernel (what
:mod:`tinylm.layers.registry` declares for this kind).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.errors import ConfigError
from tinylm.layers.dense import DequantizingLinear, replace_named_layers

SUPPORTED_BITS = range(2, 9)  # stored in int8 whatever the bit width


# --- the math as small pure functions ---------------------------------------------------


def check_scheme(bits: Any, group_size: Any, minimum: Any = False) -> None:
    """A ConfigError unless ``bits`` is in [2, 8] ([2, 7] with a ``minimum``: the unsigned
    codes 0 .. 2^bits - 1 are stored in int8) and ``group_size`` None or >= 1."""
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits must be an integer in [2, 8], got {bits!r}; e.g. --bits 8")
    if not isinstance(minimum, bool):
        raise ConfigError(f"minimum must be true or false, got {minimum!r}")
    if minimum and bits > 7:
        raise ConfigError(f"bits={bits} with a minimum does not fit int8 (unsigned codes "
                          f"0 .. 2^bits - 1); use bits <= 7")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(
            group_size, int) or group_size < 1):
        raise ConfigError(f"group size must be an integer >= 1 (input features per scale), "
                          f"got {group_size!r}; e.g. --group-size 32, or omit it for one "
                          f"scale per output channel")


def qmax_of(bits: int) -> int:
    """The largest integer of a symmetric ``bits``-bit code: 2^(bits-1) - 1."""
    return 2 ** (bits - 1) - 1


def quantize_weight(W: Tensor, bits: int = 8, group_size: int | None = None
                    ) -> tuple[Tensor, Tensor]:
    """(q int8 (O, I), scale float32 (O, n_groups)) with W ≈ q·s group by group.

    Groups are ``group_size`` consecutive input features of a row (the last one may be
    shorter); None means one group per row (per output channel).
    """
    check_scheme(bits, group_size)
    if W.dim() != 2:
        raise ValueError(f"quantize_weight needs a 2-D weight, got shape {tuple(W.shape)}")
    O, I = W.shape
    G = I if group_size is None else min(group_size, I)
    n = -(-I // G)  # groups per row, ceil(I / G)
    W = W.detach().to(torch.float32)
    padded = F.pad(W, (0, n * G - I)).view(O, n, G)  # (O, n, G), zeros pad the last group
    top = padded.abs().amax(dim=2)  # (O, n)
    scale = torch.where(top > 0, top / qmax_of(bits), torch.ones_like(top))  # (O, n)
    q = torch.round(padded / scale[:, :, None]).clamp_(-qmax_of(bits), qmax_of(bits))
    return q.view(O, n * G)[:, :I].to(torch.int8).contiguous(), scale.contiguous()


def dequantize_weight(q: Tensor, scale: Tensor, group_size: int | None = None,
                      minimum: Tensor | None = None) -> Tensor:
    """W (O, I) float32 = q·s (+ m), each scale (and minimum) repeated over its group of
    ``group_size`` input features (None: the whole row). The product is rounded before
    the minimum is added, as GGUF's own dequantization does (bit-exact with it)."""
    O, I = q.shape
    G = I if group_size is None else min(group_size, I)
    s = scale.repeat_interleave(G, dim=1)[:, :I]  # (O, n) -> (O, n·G) -> (O, I)
    w = q.to(scale.dtype) * s
    if minimum is not None:
        w = w + minimum.repeat_interleave(G, dim=1)[:, :I]
    return w


# --- the module ---------------------------------------------------------------------------


class QuantizedLinear(DequantizingLinear):
    """y = x·(q·s + m)ᵀ + b: a Linear layer whose weight is int8 integers times fp32
    scales (plus, with ``minimum=True``, a per-group fp32 minimum m; without: m = 0).

    ``qweight`` (O, I) int8, ``scale`` (O, n_groups) float32 and ``minimum`` (O, n_groups,
    or None) are buffers (not trained); ``bias`` (O,) stays a float32 parameter. Build one
    with :meth:`from_linear`, or construct it empty and load a state dict into it (what
    the checkpoint loader does).
    """

    def __init__(self, in_features: int, out_features: int, bits: int = 8,
                 group_size: int | None = None, bias: bool = True,
                 device: torch.device | str | None = None, minimum: bool = False) -> None:
        super().__init__()
        check_scheme(bits, group_size, minimum)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        G = in_features if group_size is None else min(group_size, in_features)
        n = -(-in_features // G)
        self.register_buffer("qweight", torch.zeros(out_features, in_features,
                                                    dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, n, device=device))
        self.register_buffer("minimum", torch.zeros(out_features, n, device=device)
                             if minimum else None)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, layer: nn.Linear, bits: int = 8,
                    group_size: int | None = None) -> QuantizedLinear:
        """The quantized replacement of a dense layer (its bias is copied as it is)."""
        W = layer.weight.detach()
        new = cls(layer.in_features, layer.out_features, bits, group_size,
                  bias=layer.bias is not None, device=W.device)
        q, s = quantize_weight(W, bits, group_size)
        new.qweight.copy_(q)
        new.scale.copy_(s)
        if layer.bias is not None:
            with torch.no_grad():
                new.bias.copy_(layer.bias.to(torch.float32))
        return new

    @property
    def weight(self) -> Tensor:
        """The dequantized weight in ``nn.Linear``'s (O, I) orientation, q·s (+ m)."""
        return dequantize_weight(self.qweight, self.scale, self.group_size, self.minimum)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}"
                + (", minimum=True" if self.minimum is not None else ""))


def decoding_refusal(layer: QuantizedLinear) -> str | None:
    """Why the fused decoding step's int8 kernel cannot run ``layer`` (None: it can)."""
    if layer.minimum is not None:
        return "its weight has a per-group minimum (w = q·s + m), which the int8 kernel omits"
    return None


# --- model structure (tinylm.layers.registry: config.json's "quantize") ------------------


def structure_of(model: nn.Module) -> dict[str, dict[str, Any]]:
    """{module name: {"bits": b, "group_size": G or None}} of every QuantizedLinear, with
    ``"minimum": true`` added for a layer that has one (older files never do)."""
    return {name: {"bits": m.bits, "group_size": m.group_size,
                   **({"minimum": True} if m.minimum is not None else {})}
            for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def apply_structure(model: nn.Module, layers: Any) -> nn.Module:
    """Replace the named Linear layers by empty QuantizedLinear ones (config.json's
    "quantize" entry); loading the state dict then fills qweight, scale and bias."""
    def build(layer: nn.Module, name: str, scheme: Any) -> QuantizedLinear:
        if not isinstance(scheme, dict):
            raise ConfigError(f"a scheme must be an object, got {scheme!r}")
        return QuantizedLinear(layer.in_features, layer.out_features, scheme.get("bits"),
                               scheme.get("group_size"), bias=layer.bias is not None,
                               minimum=scheme.get("minimum", False))
    return replace_named_layers(model, layers, "quantize", QuantizedLinear, build)


def dequantized(model: nn.Module) -> nn.Module:
    """``model`` with every QuantizedLinear replaced by an equivalent ``nn.Linear`` (in
    place). The model computes the same function."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantizedLinear):
            model.set_submodule(name, m.to_linear())
    return model
