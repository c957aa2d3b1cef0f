"""``tinylm compress`` as a library call: load, factorise, measure, fine-tune, write.

The math and the layer structure live in :mod:`tinylm.layers.lowrank` (below checkpoints in
the import order); this module sits above training because the fine-tune recipe
trains the factorised model (:func:`finetune_config`, :func:`finetune`).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from tinylm.core.config import TrainConfig, resolve_device
from tinylm.core.errors import ConfigError
from tinylm.data.prepare import load_prepared
from tinylm.io.checkpoint import (
    WEIGHTS_FILE,
    check_target,
    load_checkpoint,
    read_config,
    resolve_checkpoint_dir,
    save_checkpoint,
)
from tinylm.layers.lowrank import (
    DEFAULT_LAYERS,
    CompressReport,
    SweepRow,
    compress,
    plot_sweep,
    sweep,
)
from tinylm.training import train, using_threads
from tinylm.use.evaluation import EvalResult, evaluate
from tinylm.use.plotting import figure_path

log = logging.getLogger(__name__)


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
    first (:func:`tinylm.io.checkpoint.check_target`: never a run folder or a folder with
    other files; an existing checkpoint only with ``force``), so nothing is lost.
    """
    if finetune_steps < 0 or (finetune_steps and data_dir is None):
        raise ConfigError(f"--finetune {finetune_steps} needs a number of steps >= 1 and "
                          f"--data DIR to train on")
    check_target(out, force=force)
    dev = resolve_device(device)
    with using_threads(threads):
        model, tokenizer = load_checkpoint(model_dir, device=dev)
        val = load_prepared(data_dir).val if data_dir is not None else None

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
            "source": str(model_dir), "mode": report.mode, "finetune_steps": finetune_steps}})
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
        model, _tok = load_checkpoint(model_dir, device=resolve_device(device))
        val = load_prepared(data_dir).val
        rows = sweep(model, fractions, lambda m: evaluate(m, val, max_windows=eval_windows).loss,
                     layers=layers,
                     progress=lambda r: log.info("params %.3f kept: val loss %.4f, %.0f "
                                                 "tokens/s", r.params_fraction, r.loss,
                                                 r.tokens_per_s))
    return rows, (plot_sweep(rows, plot) if plot is not None else None)
