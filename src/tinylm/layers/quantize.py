"""Weight-only int8 quantization: a replaced Linear layer and ``tinylm quantize``.

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

:class:`QuantizedLinear` is the reference form (dequantize, then ``F.linear``), as
:class:`tinylm.layers.lowrank.LowRankLinear` is for factorised layers. Its int8 integers and
float32 scales are buffers (``<name>.qweight``, ``<name>.scale``) that go through the
normal checkpoint path; config.json records the scheme (``"quantize"``) so the loader
rebuilds the layers without flags. The fast paths of :mod:`tinylm.native` step aside
for it (its type is not ``nn.Linear``): the model's own forward runs, through the
native KV cache on the CPU.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.errors import CheckpointError, ConfigError

log = logging.getLogger(__name__)

SUPPORTED_BITS = range(2, 9)  # stored in int8 whatever the bit width


# --- the math as small pure functions ---------------------------------------------------


def _check_scheme(bits: Any, group_size: Any, in_features: int | None = None) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in SUPPORTED_BITS:
        raise ConfigError(f"bits must be an integer in [2, 8], got {bits!r}; e.g. --bits 8")
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
    _check_scheme(bits, group_size)
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


def dequantize_weight(q: Tensor, scale: Tensor, group_size: int | None = None) -> Tensor:
    """W (O, I) float32 = q·s, each scale repeated over its group of ``group_size``
    input features (None: the whole row)."""
    O, I = q.shape
    G = I if group_size is None else min(group_size, I)
    s = scale.repeat_interleave(G, dim=1)[:, :I]  # (O, n) -> (O, n·G) -> (O, I)
    return q.to(scale.dtype) * s


# --- the module ---------------------------------------------------------------------------


class QuantizedLinear(nn.Module):
    """y = x·(q·s)ᵀ + b: a Linear layer whose weight is int8 integers times fp32 scales.

    ``qweight`` (O, I) int8 and ``scale`` (O, n_groups) float32 are buffers (not trained);
    ``bias`` (O,) stays a float32 parameter. Build one with :meth:`from_linear`, or
    construct it empty and load a state dict into it (what the checkpoint loader does).
    """

    def __init__(self, in_features: int, out_features: int, bits: int = 8,
                 group_size: int | None = None, bias: bool = True,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        _check_scheme(bits, group_size)
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        G = in_features if group_size is None else min(group_size, in_features)
        n = -(-in_features // G)
        self.register_buffer("qweight", torch.zeros(out_features, in_features,
                                                    dtype=torch.int8, device=device))
        self.register_buffer("scale", torch.ones(out_features, n, device=device))
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
        """The dequantized weight in ``nn.Linear``'s (O, I) orientation, q·s."""
        return dequantize_weight(self.qweight, self.scale, self.group_size)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype),
                        None if self.bias is None else self.bias.to(x.dtype))

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding the dequantized weight (same function)."""
        dense = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                          device=self.qweight.device)
        with torch.no_grad():
            dense.weight.copy_(self.weight)
            if self.bias is not None:
                dense.bias.copy_(self.bias)
        return dense

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bits={self.bits}, group_size={self.group_size}, bias={self.bias is not None}")


# --- model structure (used by checkpoint.py and hf.py) ------------------------------------



def structure_of(model: nn.Module) -> dict[str, dict[str, Any]]:
    """{module name: {"bits": b, "group_size": G or None}} of every QuantizedLinear."""
    return {name: {"bits": m.bits, "group_size": m.group_size}
            for name, m in model.named_modules() if isinstance(m, QuantizedLinear)}


def apply_structure(model: nn.Module, layers: Any) -> nn.Module:
    """Replace the named Linear layers by empty QuantizedLinear ones (config.json's
    "quantize" entry); loading the state dict then fills qweight, scale and bias."""
    if not isinstance(layers, dict):
        raise CheckpointError(f"config.json's \"quantize\" entry must map layer names to "
                              f"schemes, got {layers!r}; the checkpoint is corrupt")
    for name, scheme in layers.items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            layer = None
        if not isinstance(layer, (nn.Linear, QuantizedLinear)) or not isinstance(scheme, dict):
            raise CheckpointError(f"config.json's \"quantize\" entry names {name!r}, which is "
                                  f"not a linear layer of this model (or has no scheme); the "
                                  f"checkpoint is corrupt or mixes files from different models")
        try:
            new = QuantizedLinear(layer.in_features, layer.out_features, scheme.get("bits"),
                                  scheme.get("group_size"), bias=layer.bias is not None)
        except ConfigError as exc:
            raise CheckpointError(f"config.json's quantization of {name!r} is invalid "
                                  f"({exc}); the checkpoint is corrupt") from exc
        model.set_submodule(name, new)
    return model


def dequantized(model: nn.Module) -> nn.Module:
    """``model`` with every QuantizedLinear replaced by an equivalent ``nn.Linear`` (in
    place). The model computes the same function."""
    for name, m in list(model.named_modules()):
        if isinstance(m, QuantizedLinear):
            model.set_submodule(name, m.to_linear())
    return model


# --- quantize a model ---------------------------------------------------------------------


@dataclass(frozen=True)
class LayerReport:
    """One quantized layer: shape (I -> O), groups per row, error and bytes of its weight.

    Errors are relative to the largest weight magnitude of the whole layer, per element:
    ``max_rel_error`` = max|W - q·s| / max|W|, ``mean_rel_error`` = mean|W - q·s| / mean|W|.
    """

    name: str
    in_features: int
    out_features: int
    groups: int
    max_rel_error: float
    mean_rel_error: float
    bytes_before: int
    bytes_after: int


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize` did; bytes are the weights' payload (int8 + fp32 scales)."""

    bits: int
    group_size: int | None
    layers: tuple[LayerReport, ...]
    bytes_before: int
    bytes_after: int
    val_before: Any = None  # evaluation.EvalResult on --data, when measured
    val_after: Any = None

    @property
    def scheme(self) -> str:
        per = "per output channel" if self.group_size is None else \
            f"per group of {self.group_size} inputs"
        return f"int{self.bits} symmetric, {per}"


def model_bytes(model: nn.Module) -> int:
    """Payload bytes of a model's distinct parameters and buffers (as saved)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def select_layers(model: nn.Module, layers: Sequence[str] | None = None,
                  include_head: bool = False) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` layers to quantize, in model order.

    ``layers`` are names or suffixes ("ffn.up" selects every block's up-projection,
    "blocks.0.attn.qkv" one layer); None selects every Linear layer of the blocks, which
    covers any architecture's projections. The LM head only with ``include_head``.
    """
    linear = [(n, m) for n, m in model.named_modules()
              if type(m) is nn.Linear and n != "lm_head"]
    if layers is None:
        chosen = [(n, m) for n, m in linear if n.startswith("blocks.")]
    else:
        if isinstance(layers, str):
            layers = [layers]
        names = set()
        for pattern in (p.strip() for p in layers):
            hits = [n for n, _ in linear if pattern and (n == pattern or n.endswith("." + pattern))]
            if not hits:
                kinds = sorted({n.split(".", 2)[-1] for n, _ in linear})
                raise ConfigError(f"unknown layer name {pattern!r}; choose from "
                                  f"{', '.join(kinds)} (or a full name like "
                                  f"{linear[0][0] if linear else 'blocks.0.attn.qkv'})")
            names.update(hits)
        chosen = [(n, m) for n, m in linear if n in names]
    if include_head:
        if getattr(model.config, "tie_embeddings", False):
            raise ConfigError("--include-head: this model's LM head is its token embedding "
                              "(tie_embeddings), which stays float32; drop --include-head")
        if type(model.lm_head) is nn.Linear:
            chosen.append(("lm_head", model.lm_head))
    if not chosen:
        raise ConfigError("no Linear layer to quantize (already quantized?); check --layers")
    return chosen


def quantize(model: nn.Module, bits: int = 8, group_size: int | None = None,
             layers: Sequence[str] | None = None, include_head: bool = False
             ) -> QuantizeReport:
    """Replace the chosen Linear layers of ``model`` by :class:`QuantizedLinear` in place
    (``copy.deepcopy`` first to keep the original); return the per-layer report."""
    _check_scheme(bits, group_size)
    chosen = select_layers(model, layers, include_head)
    before = model_bytes(model)
    rows = []
    for name, layer in chosen:
        W = layer.weight.detach().to(torch.float32)
        new = QuantizedLinear.from_linear(layer, bits, group_size)
        err = (W - new.weight).abs()
        top, mean = float(W.abs().max()), float(W.abs().mean())
        rows.append(LayerReport(
            name, layer.in_features, layer.out_features, new.scale.shape[1],
            float(err.max()) / top if top > 0 else 0.0,
            float(err.mean()) / mean if mean > 0 else 0.0,
            W.numel() * layer.weight.element_size(),
            new.qweight.numel() + new.scale.numel() * new.scale.element_size()))
        model.set_submodule(name, new)
        log.debug("quantized %s (%d->%d) to int%d", name, layer.in_features,
                  layer.out_features, bits)
    return QuantizeReport(bits, group_size, tuple(rows), before, model_bytes(model))


def format_report(report: QuantizeReport) -> str:
    """The report as a fixed-width table plus totals, for printing."""
    lines = [f"quantize ({report.scheme})",
             f"{'layer':<22} {'shape':>11} {'groups':>6} {'max rel.err':>11} "
             f"{'mean rel.err':>12} {'bytes before':>13} {'bytes after':>12}"]
    for r in report.layers:
        lines.append(f"{r.name:<22} {f'{r.in_features}x{r.out_features}':>11} {r.groups:>6} "
                     f"{r.max_rel_error:>11.5f} {r.mean_rel_error:>12.5f} "
                     f"{r.bytes_before:>13,} {r.bytes_after:>12,}")
    lines.append(f"weights: {report.bytes_before / 1e6:.3f} MB -> {report.bytes_after / 1e6:.3f}"
                 f" MB ({100 * (1 - report.bytes_after / report.bytes_before):.1f} % smaller)")
    b, a = report.val_before, report.val_after
    if b is not None and a is not None:
        lines.append(f"val loss: {b.loss:.4f} -> {a.loss:.4f} (perplexity {b.perplexity:.3f} "
                     f"-> {a.perplexity:.3f}, {100 * (a.loss / b.loss - 1):+.2f} %)")
    return "\n".join(lines)


def quantize_checkpoint(model_dir: str | os.PathLike, out: str | os.PathLike, *,
                        bits: int = 8, group_size: int | None = None,
                        layers: Sequence[str] | None = None, include_head: bool = False,
                        data_dir: str | os.PathLike | None = None,
                        eval_windows: int | None = None, force: bool = False
                        ) -> tuple[QuantizeReport, Path]:
    """Load ``model_dir``, quantize it, measure val loss before/after on ``data_dir``
    (a ``tinylm prepare`` folder, optional) and save it to ``out``, checked first by
    :func:`tinylm.io.checkpoint.check_target` (a new or empty folder; an existing
    checkpoint only with ``force``). Returns (report, the checkpoint folder written)."""
    from tinylm.io.checkpoint import check_target, load_checkpoint, save_checkpoint
    from tinylm.use.evaluation import evaluate

    _check_scheme(bits, group_size)
    if eval_windows is not None and eval_windows < 1:
        raise ConfigError(f"--eval-windows must be >= 1, got {eval_windows}")
    dest = check_target(out, force=force)
    model, tokenizer = load_checkpoint(model_dir)
    val = None
    if data_dir is not None:
        from tinylm.data import load_prepared

        val = load_prepared(data_dir).val
    before = evaluate(model, val, max_windows=eval_windows) if val is not None else None
    report = quantize(model, bits, group_size, layers, include_head)
    after = evaluate(model, val, max_windows=eval_windows) if val is not None else None
    report = QuantizeReport(report.bits, report.group_size, report.layers,
                            report.bytes_before, report.bytes_after, before, after)
    written = save_checkpoint(dest, model, tokenizer, extra_config={"quantized_from": {
        "source": str(model_dir), "scheme": report.scheme}})
    return report, written
