"""``tinylm quantize``: int8 (or packed 4-bit) weights for a model (:func:`quantize`), its
report, and the whole command as a library call (:func:`quantize_checkpoint`: load,
quantize, measure, write).

The schemes and the layers live in :mod:`tinylm.layers.quantized` (int8 integers, one per
byte, any bit width and group size) and :mod:`tinylm.layers.blocks` (``--bits 4
--group-size 32``: GGUF's Q4_0 blocks, or Q4_1 with ``--asymmetric``, two weights per
byte), below checkpoints in the import order; this module reads and writes checkpoints
and evaluates on prepared data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinylm.commands.measure import validation_tokens
from tinylm.core.errors import ConfigError
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import check_target, save_checkpoint
from tinylm.layers.blocks import BlockLinear
from tinylm.layers.quantized import QuantizedLinear, check_scheme
from tinylm.layers.selection import select_layers as select
from tinylm.use.evaluation import evaluate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerReport:
    """One quantized layer: shape (I -> O), groups per row, error and bytes of its weight.

    The per-weight errors share one denominator, the layer's largest weight magnitude, so
    the mean never exceeds the max: ``max_rel_error`` = max|W - q·s| / max|W|,
    ``mean_rel_error`` = mean|W - q·s| / max|W|. ``rel_error`` is the whole matrix's
    relative error ||W - q·s||_F / ||W||_F (what ``tinylm compress`` reports).
    """

    name: str
    in_features: int
    out_features: int
    groups: int
    max_rel_error: float
    mean_rel_error: float
    bytes_before: int
    bytes_after: int
    rel_error: float = 0.0


@dataclass(frozen=True)
class QuantizeReport:
    """What :func:`quantize` did; bytes are the weights' payload (int8 + fp32 scales, or
    the GGUF blocks)."""

    bits: int
    group_size: int | None
    layers: tuple[LayerReport, ...]
    bytes_before: int
    bytes_after: int
    val_before: Any = None  # evaluation.EvalResult on --data, when measured
    val_after: Any = None
    block_type: str | None = None  # "Q4_0" / "Q4_1": packed GGUF blocks

    @property
    def scheme(self) -> str:
        if self.block_type is not None:
            how = "asymmetric (scale and minimum)" if self.block_type == "Q4_1" else \
                "symmetric"
            return (f"{self.block_type}: {self.bits}-bit {how}, per group of 32 inputs, "
                    f"packed two per byte as GGUF")
        per = "per output channel" if self.group_size is None else \
            f"per group of {self.group_size} inputs"
        return f"int{self.bits} symmetric, {per}"


def block_type_of(bits: int, group_size: int | None, asymmetric: bool = False) -> str | None:
    """The GGUF block type ``--bits``/``--group-size``/``--asymmetric`` store (None: int8
    integers one per byte, :class:`QuantizedLinear`)."""
    if bits == 4 and group_size == 32:
        return "Q4_1" if asymmetric else "Q4_0"
    if asymmetric:
        raise ConfigError(f"--asymmetric is GGUF's Q4_1 and needs --bits 4 --group-size 32, "
                          f"got --bits {bits} --group-size {group_size}")
    return None


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
    """The plain ``nn.Linear`` layers to quantize, in model order.

    ``layers`` are names or suffixes (the one rule of
    :func:`tinylm.layers.selection.select_layers`: "ffn.up" selects every block's
    up-projection, "blocks.0.attn.qkv" one layer); None selects every Linear layer of the
    blocks, which covers any architecture's projections. The LM head only with
    ``include_head``.
    """
    chosen = select(model, layers)
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
             layers: Sequence[str] | None = None, include_head: bool = False,
             asymmetric: bool = False) -> QuantizeReport:
    """Replace the chosen Linear layers of ``model`` in place (``copy.deepcopy`` first to
    keep the original) by :class:`QuantizedLinear`, or with ``bits=4, group_size=32`` by
    :class:`BlockLinear` (GGUF's Q4_0; Q4_1 with ``asymmetric``; then, with every layer
    chosen, the LM head too, tied or not, as Q8_0 blocks: :func:`_head_blocks`); return
    the report."""
    check_scheme(bits, group_size)
    block_type = block_type_of(bits, group_size, asymmetric)
    chosen = select_layers(model, layers, include_head)
    before = model_bytes(model)
    rows = []
    for name, layer in chosen:
        W = layer.weight.detach().to(torch.float32)
        new = BlockLinear.from_linear(layer, block_type) if block_type else \
            QuantizedLinear.from_linear(layer, bits, group_size)
        rows.append(_layer_report(name, W, new, layer.weight.element_size()))
        model.set_submodule(name, new)
        log.debug("quantized %s (%d->%d) to %s", name, layer.in_features,
                  layer.out_features, block_type or f"int{bits}")
    if block_type is not None and layers is None and type(model.lm_head) is nn.Linear:
        rows.append(_head_blocks(model))
    return QuantizeReport(bits, group_size, tuple(rows), before, model_bytes(model),
                          block_type=block_type)


def _head_blocks(model: nn.Module) -> LayerReport:
    """The LM head (tied or not) as Q8_0 blocks, as llama-quantize keeps the output at a
    higher type than the 4-bit blocks: a tied head is the token embedding, which the
    decoding step would otherwise read in float32 (4 bytes per weight; Q8_0: 1.06). The
    embedding lookup keeps the float table; a tied model's head and embedding then differ
    by Q8_0's rounding (|w − q·d| <= d/2 per weight)."""
    head = model.lm_head
    W = head.weight.detach().to(torch.float32)
    new = BlockLinear.from_linear(head, "Q8_0")
    model.lm_head = new
    log.debug("quantized lm_head (%d->%d) to Q8_0", head.in_features, head.out_features)
    return _layer_report("lm_head", W, new, W.element_size())


def _layer_report(name: str, W: torch.Tensor, new: QuantizedLinear | BlockLinear,
                  element_size: int) -> LayerReport:
    """The report row of one layer: ``W`` (O, I) float32 before, ``new`` after (its bytes:
    the integers and scales, or the blocks)."""
    diff = W - new.weight  # (O, I)
    err = diff.abs()
    top, norm = float(W.abs().max()), float(torch.linalg.vector_norm(W))
    groups = new.scale.shape[1] if isinstance(new, QuantizedLinear) else -(-W.shape[1] // 32)
    return LayerReport(
        name, new.in_features, new.out_features, groups,
        float(err.max()) / top if top > 0 else 0.0,
        float(err.mean()) / top if top > 0 else 0.0,
        W.numel() * element_size,
        sum(b.numel() * b.element_size() for b in new.buffers()),
        float(torch.linalg.vector_norm(diff)) / norm if norm > 0 else 0.0)


#: What the error columns of :func:`format_report` mean, printed under the table.
ERROR_LEGEND = ("max err, mean err: |W - q*s| per weight over the layer's largest |W| "
                "(one denominator: mean <= max)\n"
                "rel. error: ||W - q*s|| / ||W|| of the whole matrix (Frobenius, as compress "
                "reports it)")


def format_report(report: QuantizeReport) -> str:
    """The report as a fixed-width table, what its error columns mean, and totals."""
    lines = [f"quantize ({report.scheme})",
             f"{'layer':<22} {'shape':>11} {'groups':>6} {'max err':>9} {'mean err':>9} "
             f"{'rel. error':>10} {'bytes before':>13} {'bytes after':>12}"]
    for r in report.layers:
        lines.append(f"{r.name:<22} {f'{r.in_features}x{r.out_features}':>11} {r.groups:>6} "
                     f"{r.max_rel_error:>9.5f} {r.mean_rel_error:>9.5f} {r.rel_error:>10.5f} "
                     f"{r.bytes_before:>13,} {r.bytes_after:>12,}")
    lines.append(ERROR_LEGEND)
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
                        eval_windows: int | None = None, force: bool = False,
                        asymmetric: bool = False) -> tuple[QuantizeReport, Path]:
    """Load ``model_dir``, quantize it, measure val loss before/after on ``data_dir``
    (a ``tinylm prepare`` folder, optional) and save it to ``out``, checked first by
    :func:`tinylm.io.checkpoint_files.check_target` (a new or empty folder; an existing
    checkpoint only with ``force``). Returns (report, the checkpoint folder written)."""
    check_scheme(bits, group_size)
    block_type_of(bits, group_size, asymmetric)  # refused before anything is read
    if eval_windows is not None and eval_windows < 1:
        raise ConfigError(f"--eval-windows must be >= 1, got {eval_windows}")
    dest = check_target(out, force=force)
    model, tokenizer = load_checkpoint(model_dir)
    val = None if data_dir is None else validation_tokens(data_dir, tokenizer, model_dir)
    before = evaluate(model, val, max_windows=eval_windows) if val is not None else None
    report = quantize(model, bits, group_size, layers, include_head, asymmetric)
    after = evaluate(model, val, max_windows=eval_windows) if val is not None else None
    report = QuantizeReport(report.bits, report.group_size, report.layers,
                            report.bytes_before, report.bytes_after, before, after,
                            report.block_type)
    written = save_checkpoint(dest, model, tokenizer, extra_config={"quantized_from": {
        "source": str(Path(model_dir).resolve()), "scheme": report.scheme}})
    return report, written
