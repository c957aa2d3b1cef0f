"""``tinylm compress``: factorise a model (:func:`compress`), report, sweep, and the
whole command as a library call (load, factorise, measure, fine-tune, write).

The math and the layer live in :mod:`tinylm.layers.lowrank` (below checkpoints in the
import order); this module sits above training because the fine-tune recipe trains the
factorised model (:func:`finetune_config`, :func:`finetune`), and it draws the sweep's
plot (:mod:`tinylm.use.plotting`).
"""

from __future__ import annotations

import copy
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinylm.commands.measure import validation_tokens
from tinylm.core.config import TrainConfig, resolve_device
from tinylm.core.errors import ConfigError
from tinylm.io.checkpoint import load_checkpoint, read_config, resolve_checkpoint_dir
from tinylm.io.checkpoint_files import WEIGHTS_FILE, check_target, save_checkpoint
from tinylm.layers.lowrank import (
    DEFAULT_LAYERS,
    LayerSpectrum,
    LowRankLinear,
    check_share,
    dense_weight,
    energy_rank,
    lowrank_params,
    max_saving_rank,
    ranks_for_budget,
    singular_values,
    truncation_error,
    weight_params,
)
from tinylm.layers.selection import select_layers as select
from tinylm.training import train, using_threads
from tinylm.use.evaluation import EvalResult, evaluate
from tinylm.use.plotting import figure_path, new_figure, save_figure

log = logging.getLogger(__name__)


# --- compress a model ---------------------------------------------------------------------


@dataclass(frozen=True)
class LayerReport:
    """One candidate layer: shape (E -> F), rank kept (None: left as is), cost, error."""

    name: str
    in_features: int
    out_features: int
    rank: int | None
    full_rank: int
    params_before: int
    params_after: int
    rel_error: float
    note: str = ""

    @property
    def factorised(self) -> bool:
        return self.rank is not None


@dataclass(frozen=True)
class CompressReport:
    """What :func:`compress` did: per layer, and totals for the whole model.

    Parameters count distinct tensors (a tied LM head once) including biases; bytes are
    the weights' payload as stored in model.safetensors (the file adds a small header).
    """

    mode: str
    layers: tuple[LayerReport, ...]
    params_before: int
    params_after: int
    bytes_before: int
    bytes_after: int

    @property
    def params_fraction(self) -> float:
        """Share of the parameters kept, params_after / params_before."""
        return self.params_after / self.params_before

    @property
    def reduction(self) -> float:
        """Share of parameters removed, in percent."""
        return 100.0 * (1.0 - self.params_fraction)

    @property
    def structure(self) -> dict[str, int]:
        return {r.name: r.rank for r in self.layers if r.rank is not None}


def _payload_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def select_layers(model: nn.Module, layers: Sequence[str] = DEFAULT_LAYERS
                  ) -> list[tuple[str, nn.Linear | LowRankLinear]]:
    """The layers compress may factorise that ``layers`` names, in model order: the one
    rule of :func:`tinylm.layers.selection.select_layers` over plain and already
    factorised Linear layers, the LM head never (it is usually tied to the token
    embedding). A default kind the architecture lacks (``ffn.gate`` without SwiGLU) is
    skipped when several names are given."""
    return select(model, layers, take=(nn.Linear, LowRankLinear), optional=DEFAULT_LAYERS,
                  empty="the model has no linear layers to compress")


def compress(
    model: nn.Module,
    *,
    rank: int | None = None,
    energy: float | None = None,
    params_fraction: float | None = None,
    layers: Sequence[str] = DEFAULT_LAYERS,
) -> CompressReport:
    """Factorise the chosen linear layers of ``model`` in place; return a report.

    Exactly one of ``rank`` (every layer gets rank R), ``energy`` (each layer keeps that
    share of its Σσ²) or ``params_fraction`` (the whole model keeps at most that share of
    its parameters; ranks by :func:`ranks_for_budget`) must be given. ``layers`` are name
    patterns (see :func:`select_layers`). A layer is only factorised when that saves
    parameters, r·(E + F) < its current weight count; otherwise it is left as is and the
    report says why. Already factorised layers (a compressed model) can be compressed
    again. In place, as ``torch.nn.utils.prune`` does: ``copy.deepcopy`` first to keep
    the original.
    """
    if isinstance(layers, str):
        layers = [layers]
    _check_mode(rank, energy, params_fraction)
    chosen = select_layers(model, layers)
    if rank is not None:
        too_big = [(n, m) for n, m in chosen if rank > min(m.in_features, m.out_features)]
        if too_big:
            n, m = too_big[0]
            full = min(m.in_features, m.out_features)
            raise ConfigError(
                f"rank {rank} is above the full rank {full} of {n} ({m.in_features}->"
                f"{m.out_features}); choose --rank below "
                f"{max_saving_rank(m.in_features, m.out_features) + 1} to save parameters")

    params_before = sum(p.numel() for p in model.parameters())
    bytes_before = _payload_bytes(model)
    spectra = [LayerSpectrum(n, m.in_features, m.out_features, weight_params(m),
                             singular_values(dense_weight(m))) for n, m in chosen]

    if rank is not None:
        mode = f"rank={rank}"
        wanted: list[int | None] = [rank] * len(chosen)
    elif energy is not None:
        mode = f"energy={energy:g}"
        wanted = [energy_rank(s.sigma, energy) for s in spectra]
    else:
        mode = f"params_fraction={params_fraction:g}"
        fixed = params_before - sum(s.params for s in spectra)
        floor = fixed + sum(s.in_features + s.out_features for s in spectra)
        if params_fraction * params_before < floor:
            raise ConfigError(
                f"params fraction {params_fraction:g} cannot be reached by factorising "
                f"{', '.join(layers)}: even rank 1 everywhere keeps {floor / params_before:.3f} "
                f"of the {params_before:,} parameters (embeddings and other layers stay); "
                f"choose a fraction >= {math.ceil(floor / params_before * 1000) / 1000:g}")
        wanted = ranks_for_budget(spectra, params_fraction * params_before - fixed)

    rows = _factorise(model, chosen, spectra, wanted)
    params_after = sum(p.numel() for p in model.parameters())
    return CompressReport(mode, tuple(rows), params_before, params_after, bytes_before,
                          _payload_bytes(model))


def _check_mode(rank: int | None, energy: float | None, params_fraction: float | None) -> None:
    given = [k for k, v in (("rank", rank), ("energy", energy),
                            ("params_fraction", params_fraction)) if v is not None]
    if len(given) != 1:
        raise ConfigError(f"choose exactly one of rank, energy or params_fraction "
                          f"(--rank, --energy, --params-fraction), got "
                          f"{', '.join(given) or 'none'}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ConfigError(f"rank must be an integer >= 1, got {rank!r}; e.g. --rank 16")
    if energy is not None:
        check_share("energy", energy)
    if params_fraction is not None:
        check_share("params fraction", params_fraction)


def _factorise(model: nn.Module, chosen: list[tuple[str, nn.Module]],
               spectra: list[LayerSpectrum], wanted: list[int | None]) -> list[LayerReport]:
    """Replace each chosen layer by its rank-r factorisation where that saves parameters;
    one report row per layer."""
    rows = []
    for (name, layer), spec, r in zip(chosen, spectra, wanted, strict=True):
        E, Fo, full = spec.in_features, spec.out_features, min(spec.in_features,
                                                                 spec.out_features)
        bias = 0 if layer.bias is None else layer.bias.numel()
        before = spec.params + bias
        if r is not None and r * (E + Fo) >= spec.params:
            note = (f"kept: rank {r} would not save parameters "
                    f"(needs rank <= {max_saving_rank(E, Fo)})"
                    if isinstance(layer, nn.Linear) else
                    f"kept: already rank {layer.rank}")
            r = None
        elif r is None:
            note = "kept: factorising would not save parameters at this budget"
        else:
            note = ""
        if r is None:
            rows.append(LayerReport(name, E, Fo, None, full, before, before, 0.0, note))
            continue
        model.set_submodule(name, LowRankLinear.from_linear(layer, r))
        rows.append(LayerReport(name, E, Fo, r, full, before, lowrank_params(E, Fo, r, False)
                                + bias, truncation_error(spec.sigma, r)))
        log.debug("factorised %s (%d->%d) at rank %d", name, E, Fo, r)
    return rows


def format_report(report: CompressReport) -> str:
    """The report as a fixed-width table plus totals, for printing."""
    lines = [f"compress ({report.mode})",
             f"{'layer':<22} {'shape':>11} {'rank':>9} {'params before':>14} "
             f"{'params after':>13} {'rel. error':>10}"]
    for r in report.layers:
        shape = f"{r.in_features}x{r.out_features}"
        rank = f"{r.rank}/{r.full_rank}" if r.rank is not None else f"-/{r.full_rank}"
        lines.append(f"{r.name:<22} {shape:>11} {rank:>9} {r.params_before:>14,} "
                     f"{r.params_after:>13,} {r.rel_error:>10.4f}"
                     + (f"  {r.note}" if r.note else ""))
    lines.append(f"parameters: {report.params_before:,} -> {report.params_after:,} "
                 f"({report.reduction:.1f} % fewer, {report.params_fraction:.3f} kept)")
    lines.append(f"weights: {report.bytes_before / 1e6:.2f} MB -> "
                 f"{report.bytes_after / 1e6:.2f} MB")
    return "\n".join(lines)


# --- measuring the trade-off --------------------------------------------------------------


def forward_tokens_per_second(
    model: nn.Module,
    *,
    batch_size: int = 8,
    context_length: int | None = None,
    repeats: int = 7,
    warmup: int = 2,
    device: torch.device | str | None = None,
) -> float:
    """Inference speed: tokens/s of a full forward pass over random ids (B, C).

    Median over ``repeats`` timed passes after ``warmup`` untimed ones, under
    ``torch.inference_mode``. C defaults to the model's context length.
    """
    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    C = context_length or model.config.context_length
    ids = torch.randint(0, model.config.vocab_size, (batch_size, C), device=device)  # (B, C)
    was_training = model.training
    model.eval()
    times = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model(ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    model.train(was_training)
    return batch_size * C / statistics.median(times)


@dataclass(frozen=True)
class SweepRow:
    """One point of a sweep: the fraction asked for, what was kept, loss and speed."""

    target: float
    params: int
    params_fraction: float
    loss: float
    tokens_per_s: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


def sweep(
    model: nn.Module,
    fractions: Sequence[float],
    loss_fn: Callable[[nn.Module], float],
    *,
    layers: Sequence[str] = DEFAULT_LAYERS,
    rounds: int = 5,
    speed_kwargs: dict | None = None,
    progress: Callable[[SweepRow], None] | None = None,
) -> list[SweepRow]:
    """Compress a copy of ``model`` to each parameter fraction; measure loss and speed.

    The first row is the model itself (target 1.0, as given). ``loss_fn(model)`` returns
    the validation loss (e.g. ``evaluation.evaluate(m, val).loss``). Speed is
    :func:`forward_tokens_per_second` (3 timed passes, ``speed_kwargs`` override), taken
    in ``rounds`` interleaved rounds over all the models so that load changes on a shared
    machine hit every model alike; the row holds the median over rounds. ``model`` is not
    changed.
    """
    for f in fractions:
        check_share("params fraction", f)
    fractions = _reachable(model, fractions, layers)
    total = sum(p.numel() for p in model.parameters())
    models, losses = [], []
    for target in [1.0, *fractions]:
        m = model if not models else copy.deepcopy(model)
        if len(models) > 0:
            compress(m, params_fraction=target, layers=layers)
        models.append(m)
        losses.append(float(loss_fn(m)))
    kwargs = {"repeats": 3, "warmup": 1, **(speed_kwargs or {})}
    speeds: list[list[float]] = [[] for _ in models]
    for _ in range(rounds):
        for i, m in enumerate(models):
            speeds[i].append(forward_tokens_per_second(m, **kwargs))
    rows = []
    for target, m, loss, speed in zip([1.0, *fractions], models, losses, speeds, strict=True):
        params = sum(p.numel() for p in m.parameters())
        rows.append(SweepRow(target, params, params / total, loss, statistics.median(speed)))
        if progress is not None:
            progress(rows[-1])
    return rows


def smallest_fraction(model: nn.Module, layers: Sequence[str] = DEFAULT_LAYERS) -> float:
    """The smallest parameter fraction factorising ``layers`` can reach: every chosen layer
    at rank 1, the embeddings and all other parameters kept."""
    chosen = select_layers(model, [layers] if isinstance(layers, str) else layers)
    total = sum(p.numel() for p in model.parameters())
    fixed = total - sum(weight_params(m) for _, m in chosen)
    return (fixed + sum(m.in_features + m.out_features for _, m in chosen)) / total


def _reachable(model: nn.Module, fractions: Sequence[float],
               layers: Sequence[str]) -> list[float]:
    """The sweep's fractions this model can reach; the others are named once and left out
    (a small model's embeddings alone may hold more than the smallest default fraction)."""
    floor = smallest_fraction(model, layers)
    kept = [f for f in fractions if f >= floor]
    if not kept:
        raise ConfigError(f"no sweep fraction can be reached: even rank 1 everywhere keeps "
                          f"{floor:.3f} of the parameters; choose --fractions >= "
                          f"{math.ceil(floor * 1000) / 1000:g}")
    if len(kept) < len(fractions):
        left = ", ".join(f"{f:g}" for f in fractions if f < floor)
        log.warning("sweep: left out %s, below the %.3f of the parameters that rank 1 "
                    "everywhere keeps on this model", left, floor)
    return kept


def format_sweep(rows: Sequence[SweepRow]) -> str:
    """The sweep as a Markdown table (also readable on a terminal)."""
    base = rows[0]
    lines = ["| target | params kept | params | val loss | perplexity | tokens/s | speed |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        target = "original" if r is base else f"{r.target:g}"
        lines.append(f"| {target} | {r.params_fraction:.3f} | {r.params:,} | {r.loss:.4f} | "
                     f"{r.perplexity:.3f} | {r.tokens_per_s:,.0f} | "
                     f"{r.tokens_per_s / base.tokens_per_s:.2f}x |")
    return "\n".join(lines)


def plot_sweep(rows: Sequence[SweepRow], path: str | Path, title: str | None = None) -> Path:
    """Validation loss vs share of parameters kept, speed on a second axis; written in
    the format of ``path``'s suffix (:func:`tinylm.use.plotting.save_figure`), returns the
    file really written."""
    figure_path(path)
    rows = sorted(rows, key=lambda r: r.params_fraction)
    x = [r.params_fraction for r in rows]
    fig = new_figure(6.4, 4.2, dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(x, [r.loss for r in rows], "o-", color="C0", label="validation loss")
    ax.set_xlabel("share of parameters kept")
    ax.set_ylabel("validation loss (nats/token)", color="C0")
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(x, [r.tokens_per_s for r in rows], "s--", color="C1", label="forward tokens/s")
    ax2.set_ylabel("forward pass tokens/s", color="C1")
    ax.set_title(title or "tinylm compress: loss and speed vs parameters kept")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)


# --- the command ---------------------------------------------------------------------------


def finetune_config(source_config: dict[str, Any], steps: int, *, lr: float | None = None,
                    batch_size: int = 32, device: str = "cpu") -> TrainConfig:
    """The recipe for fine-tuning a factorised model for ``steps`` steps.

    The peak lr is the one the model was trained with (``source_config["train"]["lr"]``,
    else 1e-3) unless ``lr`` is given: a factorised model must move its weights about
    as far as training did (3e-4 left make demo's model at +12 % loss, 3e-3 at +3 %, at
    --params-fraction 0.5 and 200 steps; BENCHMARKS.md). Warm-up is a tenth of the steps
    (at most 20); one evaluation and one save, at the end.
    """
    if lr is None:
        lr = source_config.get("train", {}).get("lr", 1e-3)
    return TrainConfig(max_steps=steps, lr=lr, batch_size=batch_size,
                       warmup_steps=min(20, steps // 10), eval_every=steps, save_every=steps,
                       device=device)


def finetune(model: nn.Module, data_dir: str | os.PathLike, config: TrainConfig,
             scratch: str | os.PathLike, tokenizer: Any | None = None) -> None:
    """Train ``model`` in place with ``config``; the run folder is a temporary one under
    ``scratch`` (removed afterwards). ``tokenizer`` (the model's) must match the data's."""
    with tempfile.TemporaryDirectory(prefix=".finetune-", dir=scratch) as run:
        train(model.config, config, data_dir, run, model=model, model_tokenizer=tokenizer,
              progress=False)


@dataclass(frozen=True)
class CompressOutcome:
    """What :func:`compress_checkpoint` did (``before``/``after``/``tuned`` are
    validation results when data was given)."""

    report: CompressReport
    dest: Path
    before: EvalResult | None
    after: EvalResult | None
    tuned: EvalResult | None
    finetune_steps: int
    bytes_in: int
    bytes_out: int


def compress_checkpoint(model_dir: str | os.PathLike, out: str | os.PathLike, *,
                        mode: dict[str, Any], layers: Sequence[str] = DEFAULT_LAYERS,
                        data_dir: str | os.PathLike | None = None,
                        eval_windows: int | None = None, finetune_steps: int = 0,
                        lr: float | None = None, batch_size: int = 32, device: str = "auto",
                        threads: int | None = None, force: bool = False) -> CompressOutcome:
    """Compress the checkpoint ``model_dir`` into ``out`` (see ``tinylm compress --help``).

    ``mode`` holds exactly one of rank / energy / params_fraction. ``out`` is checked
    first (:func:`tinylm.io.checkpoint_files.check_target`: never a run folder or a folder with
    other files; an existing checkpoint only with ``force``), so nothing is lost.
    """
    if finetune_steps < 0 or (finetune_steps and data_dir is None):
        raise ConfigError(f"--finetune {finetune_steps} needs a number of steps >= 1 and "
                          f"--data DIR to train on")
    check_target(out, force=force)
    dev = resolve_device(device)
    with using_threads(threads):
        model, tokenizer = load_checkpoint(model_dir, device=dev)
        val = None if data_dir is None else validation_tokens(data_dir, tokenizer, model_dir)

        def measure(m: nn.Module) -> EvalResult | None:
            return None if val is None else evaluate(m, val, max_windows=eval_windows)

        before = measure(model)
        report = compress(model, layers=layers, **mode)
        after = measure(model)
        tuned = None
        if finetune_steps:
            dest_parent = Path(out).resolve().parent
            dest_parent.mkdir(parents=True, exist_ok=True)
            cfg = finetune_config(read_config(model_dir), finetune_steps, lr=lr,
                                  batch_size=batch_size, device=str(dev))
            finetune(model, data_dir, cfg, dest_parent, tokenizer)
            tuned = measure(model)
        dest = save_checkpoint(out, model, tokenizer, extra_config={"compress": {
            "source": str(Path(model_dir).resolve()), "mode": report.mode,
            "finetune_steps": finetune_steps}})
    size_in = (resolve_checkpoint_dir(model_dir) / WEIGHTS_FILE).stat().st_size
    size_out = (dest / WEIGHTS_FILE).stat().st_size
    return CompressOutcome(report, dest, before, after, tuned, finetune_steps, size_in,
                           size_out)


def sweep_checkpoint(model_dir: str | os.PathLike, data_dir: str | os.PathLike,
                     fractions: Sequence[float], *, layers: Sequence[str] = DEFAULT_LAYERS,
                     eval_windows: int | None = None, plot: str | os.PathLike | None = None,
                     device: str = "auto", threads: int | None = None
                     ) -> tuple[list[SweepRow], Path | None]:
    """``tinylm compress --sweep``: rows per fraction, and the plot file really written
    (a name without a suffix gets ``.png``; other suffixes than png/svg/pdf are refused
    before any work)."""
    if plot is not None:
        figure_path(plot)
    with using_threads(threads):
        model, tokenizer = load_checkpoint(model_dir, device=resolve_device(device))
        val = validation_tokens(data_dir, tokenizer, model_dir)
        rows = sweep(model, fractions, lambda m: evaluate(m, val, max_windows=eval_windows).loss,
                     layers=layers,
                     progress=lambda r: log.info("params %.3f kept: val loss %.4f, %.0f "
                                                 "tokens/s", r.params_fraction, r.loss,
                                                 r.tokens_per_s))
    return rows, (plot_sweep(rows, plot) if plot is not None else None)
