"""The training loop: schedule, accumulation, clipping, evaluation, checkpoints, metrics.

``train(model_config, train_config, data_dir, out_dir)`` turns a prepared data folder
into a run folder::

    OUT/latest/       the newest checkpoint (model, config, tokenizer, training state)
    OUT/best/         the checkpoint with the lowest periodic validation estimate
    OUT/metrics.jsonl one JSON object per logged step (train loss, val estimate, lr, ...)
    OUT/loss.png      train loss, val estimates and the final val loss vs step
    OUT/run.toml      the effective configuration (reusable with --config)
    OUT/.lock         held (an OS lock) while a process trains into OUT

:func:`train` is a loop over named phases around one run-state object (:class:`_Run`):
restore (``_find_run``, ``_setup``, ``_restore``), step (``_train_step``), control
(``_control``), log (``_log_phase``), evaluate (``_eval_phase``), save
(``_save_latest``), finish (``_finish``).

Choices, and why:

* AdamW with decoupled weight decay on weight *matrices* only: every 2-D parameter
  that is not an embedding table (attention qkv/out, FFN up/down, low-rank factors).
  Biases, LayerNorm gains and the token/positional embeddings are not decayed: they
  are not "capacity" that decay should shrink, and the token embedding doubles as the
  tied LM head, whose rows for rare tokens would otherwise be decayed to zero.
* Learning rate: linear warm-up, then a cosine to ``lr * min_lr_ratio`` (:func:`lr_at`).
  With ``time_budget`` the cosine's length is the number of steps the budget allows
  at the measured speed, so a run on a slower machine still ends at the floor.
* Batches are random windows drawn from one ``torch.Generator`` (data.get_batch), the
  same global batch on every rank, each rank keeping its slice: N ranks of batch B
  train like one process of batch N·B (distributed.py).
* Exact resume: weights, optimizer moments, the data generator, every rank's dropout
  RNG and the partial loss accumulators are in OUT/latest, so on CPU a killed and
  resumed run ends bitwise equal to an uninterrupted one (time budgets excepted:
  they depend on the clock).
* No per-step host syncs: losses and finiteness flags stay on the device and are read
  only at log, eval and save points. A non-finite loss stops the run before anything
  is saved, so OUT/latest is always the last good state.
* Periodic validation is an unbiased estimate: the mean loss over a fixed random
  sample of ``eval_windows`` windows drawn across the whole split (the same sample at
  every evaluation, so best/ compares like with like); the final value is exact, over
  the whole split. metrics.jsonl keeps them apart (``val_loss_estimate`` vs
  ``val_loss`` with ``final: true``), and so does loss.png.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import Tensor, nn

from tinylm import acceleration
from tinylm.core.config import (
    ModelConfig,
    TrainConfig,
    available_cpus,
    default_threads,
    read_toml,
    resolve_arch,
    resolve_device,
    to_toml,
)
from tinylm.core.errors import CheckpointError, ConfigError, DataError, TinyLMError
from tinylm.core.model import GPT, lm_loss
from tinylm.data import get_batch, load_prepared
from tinylm.io.checkpoint import (
    CONFIG_FILE,
    RUN_BEST,
    RUN_LATEST,
    SHARDS_DIR,
    STATE_JSON_FILE,
    build_model,
    check_target,
    is_complete,
    is_sharded,
    load_model,
    load_optimizer_state,
    load_tokenizer_of,
    load_train_state,
    new_temporary,
    optimizer_state,
    read_config,
    recover_checkpoint,
    resolve_checkpoint_dir,
    save_checkpoint,
    unwrap_model,
)
from tinylm.io.files import FolderLock, atomic_write, disk_errors
from tinylm.layers.registry import SECTIONS as STRUCTURE_SECTIONS
from tinylm.training import distributed
from tinylm.use.evaluation import (
    check_same_tokenizer,
    estimate_loss,
    evaluate,
    perplexity,
    sample_windows,
)
from tinylm.use.plotting import figure_path, new_figure, readable_log_axis, save_figure

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
RUN_CONFIG_FILE = "run.toml"


class NonFiniteLossError(ConfigError):
    """The loss or gradient became NaN/inf; the last good checkpoint is kept."""


# --- math: the learning-rate schedule -----------------------------------------------------


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: float,
          min_lr_ratio: float) -> float:
    """Learning rate of optimizer step ``step`` (0-based).

    Linear warm-up ``lr * (step + 1) / warmup_steps`` for the first ``warmup_steps``
    steps, then a half cosine from ``lr`` down to the floor ``lr * min_lr_ratio``,
    reached at ``total_steps`` and held after it.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    floor = lr * min_lr_ratio
    span = total_steps - warmup_steps
    if span <= 0:
        return floor
    progress = min(1.0, (step - warmup_steps) / span)
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's lr to ``lr`` times the group's ``lr_ratio`` (1 unless
    :func:`optimizer_recipe` gave it one: an untied token embedding's)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_ratio", 1.0)


# --- optimizer ----------------------------------------------------------------------------


def decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Parameter groups: 2-D non-embedding weights decay, everything else does not.

    A tied LM head is the token embedding (listed once, not decayed).
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for p in model.parameters():  # distinct parameters, in registration order
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and id(p) not in embedding_params else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def optimizer_recipe(model: nn.Module, config: TrainConfig, device: torch.device
                     ) -> tuple[type, list[dict[str, Any]], dict[str, Any]]:
    """(class, parameter groups, keyword arguments) of the optimizer named by
    ``config.optimizer``: see :func:`build_optimizer`."""
    groups = _embedding_group(model, decay_groups(model, config.weight_decay),
                              config.embedding_lr_ratio)
    kwargs = {"lr": config.lr, "betas": (config.beta1, config.beta2),
              "fused": device.type in ("cuda", "cpu")}
    if config.optimizer == "adamw":
        return torch.optim.AdamW, groups, kwargs
    if config.optimizer == "muon":
        head = getattr(model, "lm_head", None)
        heads = {id(head.weight)} if isinstance(head, nn.Module) and \
            isinstance(getattr(head, "weight", None), Tensor) else set()
        decay = groups[0]["params"]
        groups = [{"params": [p for p in decay if id(p) not in heads], "muon": True,
                   "weight_decay": config.weight_decay},
                  {"params": [p for p in decay if id(p) in heads],
                   "weight_decay": config.weight_decay}, groups[1]]
        return MuonAdamW, [g for g in groups if g["params"]], kwargs
    raise ConfigError(f"unknown optimizer {config.optimizer!r}")  # config validates first


def _embedding_group(model: nn.Module, groups: list[dict[str, Any]], ratio: float
                     ) -> list[dict[str, Any]]:
    """``groups`` with an untied token embedding (a table of its own, not the LM head)
    moved into a group of its own at ``ratio`` × the lr (``lr_ratio``, see :func:`set_lr`).
    With ratio 1 (the default) the groups are unchanged, so older runs resume."""
    weight = getattr(getattr(model, "tok_emb", None), "weight", None)
    head = getattr(getattr(model, "lm_head", None), "weight", None)
    if ratio == 1.0 or not isinstance(weight, Tensor) or weight is head \
            or not weight.requires_grad:
        return groups
    out = []
    for group in groups:
        rest = [p for p in group["params"] if p is not weight]
        if len(rest) < len(group["params"]):
            out.append({**group, "params": [weight], "lr_ratio": ratio})
        if rest:
            out.append({**group, "params": rest})
    return out


def build_optimizer(model: nn.Module, config: TrainConfig,
                    device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer`` over ``model``'s parameters.

    "adamw": torch AdamW (fused kernel where the device supports it) on
    :func:`decay_groups`. "muon": :class:`MuonAdamW`, Muon on the decayed weight
    matrices of the blocks and AdamW on the rest: embeddings, norms, biases and an
    untied LM head (a classifier over the vocabulary, not a hidden transform; Muon's
    authors keep it on AdamW too). Fewer steps to a given loss on tiny Shakespeare (see
    BENCHMARKS.md). Add new choices here and to config.OPTIMIZERS. Under ``--strategy
    zero1`` the same recipe is sharded over the ranks
    (:func:`tinylm.training.distributed.zero_optimizer`).
    """
    cls, groups, kwargs = optimizer_recipe(model, config, device)
    return cls(groups, **kwargs)


def newton_schulz(G: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise a matrix (M, N), or each of a stack (S, M, N): U·Vᵀ of
    its SVD, singular values ~1.

    The quintic Newton–Schulz iteration of Muon (Keller Jordan), with its coefficients
    (3.4445, -4.775, 2.0315), as in ``torch.optim.Muon`` — but in the input's dtype:
    torch's casts to bf16, which is slow and coarse on CPUs. Each iteration is
    X ← a·X + (b·A + c·A²)·X with A = X·Xᵀ, written as two fused multiply-adds
    (``baddbmm``: beta·input + alpha·product), so a stack of same-shaped matrices (one
    per layer) costs three batched products per iteration and no elementwise passes.
    """
    a, b, c = 3.4445, -4.775, 2.0315
    X = G if G.dim() == 3 else G[None]  # (S, M, N)
    X = X / (torch.linalg.matrix_norm(X, keepdim=True) + eps)  # spectral <= Frobenius <= 1
    wide = X.shape[1] <= X.shape[2]
    X = X if wide else X.mT  # (S, min, max): the Gram matrix is the small one
    for _ in range(steps):
        A = X @ X.mT  # (S, min, min)
        B = torch.baddbmm(A, A, A, beta=b, alpha=c)  # b·A + c·A·A
        X = torch.baddbmm(X, B, X, beta=a)  # a·X + B·X
    X = X if wide else X.mT
    return X if G.dim() == 3 else X[0]


class MuonAdamW(torch.optim.AdamW):
    """Muon for the parameter groups marked ``muon=True`` (2-D weight matrices), AdamW
    for the others (embeddings, biases, LayerNorm gains), as one optimizer.

    Muon step for a matrix W (out, in) with gradient G: momentum buffer
    M ← μ·M + (1-μ)·G, Nesterov update U = (1-μ)·G + μ·M (torch.optim.Muon's form),
    W ← W·(1 - η·λ) - η·√max(1, out/in)·NS(U) with η = ``muon_lr_ratio`` × the group's lr.
    One lr drives both parts, so the warm-up/cosine schedule of :func:`train` applies
    unchanged; the state is an ordinary ``state_dict`` (checkpoints and resume work).
    Under fsdp each sharded matrix is gathered whole for its Newton–Schulz step.
    """

    def __init__(self, params: Any, lr: float = 1e-3, *, momentum: float = 0.95,
                 muon_lr_ratio: float = 10.0, ns_steps: int = 5, **adamw: Any) -> None:
        super().__init__(params, lr=lr, **adamw)
        for group in self.param_groups:
            group.setdefault("muon", False)
            group.setdefault("momentum", momentum)
            group.setdefault("muon_lr_ratio", muon_lr_ratio)
            group.setdefault("ns_steps", ns_steps)
            if group["muon"] and any(p.dim() != 2 for p in group["params"]):
                raise ValueError("Muon groups may hold only 2-D weight matrices")

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        groups = self.param_groups
        self.param_groups = [g for g in groups if not g["muon"]]
        try:
            loss = super().step(closure)  # AdamW on the non-Muon groups
        finally:
            self.param_groups = groups
        for group in groups:
            if group["muon"]:
                self._muon_step(group)
        return loss

    def _muon_step(self, group: dict[str, Any]) -> None:
        """One Muon step for every matrix of ``group``: the matrices of one shape (one
        per layer) go through :func:`newton_schulz` as one stack."""
        lr, mu = group["lr"] * group["muon_lr_ratio"], group["momentum"]
        by_shape: dict[tuple[int, ...], list[Tensor]] = {}
        for p in group["params"]:
            if p.grad is not None:
                by_shape.setdefault(tuple(p.shape), []).append(p)  # a DTensor's: global
        for params in by_shape.values():
            updates = []
            for p in params:
                state = self.state[p]
                if "momentum_buffer" not in state:  # "step" too: AdamW's loader expects it
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] += 1
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                # Muon needs the whole matrix: under fsdp gather it, orthogonalise it (the
                # same on every rank) and keep this rank's rows; else this is a no-op.
                updates.append(distributed.full_tensor(p.grad.lerp(buf, mu)))
            for p, update in zip(params, newton_schulz(torch.stack(updates), group["ns_steps"]),
                                 strict=True):
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(distributed.shard_like(update, p),
                       alpha=-lr * math.sqrt(max(1.0, update.shape[0] / update.shape[1])))


# --- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainResult:
    """What a call to :func:`train` achieved.

    ``final_val_loss`` is over the whole validation split (None when interrupted, or
    when a finished run was resumed and did nothing); ``best_val_loss`` the lowest
    periodic *estimate* (the same fixed sample of ``eval_windows`` windows each time, so
    like is compared with like). ``tokens_per_s`` counts training tokens of all ranks
    over training time (evaluation and saving excluded). ``stop_reason`` is
    "max_steps", "time_budget", "interrupted" or "finished" (resumed a run that had
    already reached its end: nothing was changed). ``resumed_from`` is the step a
    resume started at (None for a new run).
    """

    out_dir: Path
    steps: int
    final_val_loss: float | None
    final_val_perplexity: float | None
    best_val_loss: float | None
    tokens_per_s: float
    elapsed: float
    stop_reason: str
    rank: int = 0
    resumed_from: int | None = None

    @property
    def checkpoint(self) -> Path:
        return self.out_dir / RUN_LATEST

    @property
    def interrupted(self) -> bool:
        return self.stop_reason == "interrupted"


# --- metrics and plots --------------------------------------------------------------------


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of RUN_DIR/metrics.jsonl (a torn last line from a crash is skipped)."""
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise DataError(f"{path} does not exist; pass a run folder written by tinylm train")
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _series(records: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(r["step"], r[key]) for r in records
            if isinstance(r.get(key), (int, float)) and "step" in r]


def plot_losses(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: str | os.PathLike,
                *, log_scale: bool = False, title: str | None = None) -> Path:
    """Draw, per (label, records): train loss (thin line), the periodic validation
    estimate (dots on a line) and the final whole-split validation loss (a star), kept
    apart because they are different measurements. Written atomically in the format of
    ``out``'s suffix (PNG, SVG or PDF; :func:`tinylm.use.plotting.save_figure`)."""
    figure_path(out)  # refuse a bad name before drawing
    fig = new_figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for i, (label, records) in enumerate(runs):
        color = f"C{i % 10}"
        tr = _series(records, "train_loss")
        est = _series(records, "val_loss_estimate")
        if not est:  # a run folder from before the estimates had their own key
            est = _series([r for r in records if not r.get("final")], "val_loss")
        exact = _series([r for r in records if r.get("final")], "val_loss")
        if tr:
            ax.plot(*zip(*tr, strict=True), color=color, alpha=0.6, lw=1,
                    label=f"{label} train")
        if est:
            ax.plot(*zip(*est, strict=True), color=color, marker="o", ms=3, lw=1.5,
                    label=f"{label} val (sample estimate)")
        if exact:
            ax.plot(*zip(*exact, strict=True), color=color, marker="*", ms=11, lw=0,
                    label=f"{label} val (whole split)")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if log_scale:
        ax.set_yscale("log")
        readable_log_axis(ax.yaxis)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return save_figure(fig, out, bbox_inches="tight")


def plot_runs(run_dirs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
              log_scale: bool = False) -> Path:
    """One figure comparing the loss curves of several run folders (``tinylm plot``)."""
    figure_path(out)
    runs = [(Path(d).resolve().name, read_metrics(d)) for d in run_dirs]
    if not any(records for _, records in runs):
        raise DataError(f"no metrics recorded yet in {', '.join(map(str, run_dirs))}")
    return plot_losses(runs, out, log_scale=log_scale)


class _MetricsLog:
    """Appends records to metrics.jsonl (rank 0 only) and keeps them for the plot."""

    def __init__(self, out: Path, enabled: bool, resume_step: int | None) -> None:
        self.path = out / METRICS_FILE
        self.enabled = enabled
        self.records: list[dict[str, Any]] = []
        if not enabled:
            return
        if resume_step is not None and self.path.is_file():
            # Drop what a killed run logged after its last checkpoint: it is replayed.
            self.records = [r for r in read_metrics(out) if r.get("step", 0) <= resume_step]
        atomic_write(self.path, "".join(json.dumps(r) + "\n" for r in self.records))
        with disk_errors(self.path):
            self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        with disk_errors(self.path):
            self._append(json.dumps(record) + "\n")

    def _append(self, line: str) -> None:
        self._file.write(line)
        self._file.flush()

    def close(self) -> None:
        if self.enabled:
            with contextlib.suppress(OSError):
                self._file.close()


# --- progress display ---------------------------------------------------------------------


def _fmt_seconds(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Progress:
    """A tqdm bar on a terminal at least 20 columns wide, plain log lines otherwise
    (CI, pipes, a 0-column terminal). :meth:`open` starts the bar, after the header."""

    def __init__(self, enabled: bool, use_bar: bool | None) -> None:
        self.enabled = enabled
        if use_bar is None:
            use_bar = sys.stderr.isatty() and shutil.get_terminal_size((0, 0)).columns >= 20
        self.use_bar = enabled and use_bar
        self.bar = None

    def open(self, start: int, total: int) -> None:
        if self.use_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="train", unit="step",
                            dynamic_ncols=True, file=sys.stderr)

    def set_total(self, total: int) -> None:
        if self.bar is not None and self.bar.total != total:
            self.bar.total = total
            self.bar.refresh()

    def step(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def report(self, step: int, total: int, loss: float, lr: float, tok_s: float,
               eta: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}",
                                 refresh=False)
        else:
            log.info("step %d/%d | loss %.4f | lr %.2e | %s tok/s | eta %s", step, total,
                     loss, lr, f"{tok_s:,.0f}", _fmt_seconds(eta))

    def message(self, text: str, level: int = logging.INFO) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            log.log(level, "%s", text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# --- faults -------------------------------------------------------------------------------


class _StopSignal:
    """SIGINT/SIGTERM handler: the first one asks the loop to save and stop at the next
    step boundary; a second one interrupts immediately."""

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __call__(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt
        self.received = signum

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopSignal]:
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self)
        try:
            yield self
        finally:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)


def _prepare_out(out: Path) -> None:
    """Create the run folder; a file in its place or an unwritable parent is one line."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a folder; choose a folder name "
                              f"for the run (nothing was written)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"output folder {out} is not writable ({exc.strerror or exc}); "
                              f"choose another --out") from exc


def preflight(out: Path, n_params: int) -> None:
    """Fail before training when ``out`` cannot hold the run's checkpoints.

    Checks that the folder can be created and written, and that the free space covers
    latest/ (weights + two AdamW moments), best/ and one temporary copy during a save.
    """
    _prepare_out(out)
    try:
        probe = out / f".write-test-{os.getpid()}"
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as exc:
        raise CheckpointError(f"output folder {out} is not writable ({exc.strerror or exc}); "
                              f"choose another --out") from exc
    need = n_params * 4 * (3 + 1 + 3) + (16 << 20)
    free = shutil.disk_usage(out).free
    if free < need:
        raise CheckpointError(f"only {free / 2**20:,.0f} MiB free in {out}, but the run's "
                              f"checkpoints need about {need / 2**20:,.0f} MiB; free disk "
                              f"space or choose another --out")


# --- data ---------------------------------------------------------------------------------


class TrainData(Protocol):
    """What :func:`train` reads from its data (``tinylm.data.PreparedData`` is one).

    ``train``/``val`` are 1-D integer token arrays (numpy arrays or memmaps);
    ``tokenizer`` made them. Optional ``train_mask``/``val_mask`` (same length as the
    split, 0/1): a target token whose mask is 0 does not count in the loss (e.g. the
    prompt part of a chat fine-tuning example); a training batch with no counted target
    is an error. ``dir`` (optional) names the data in messages.
    """

    tokenizer: Any
    train: Any
    val: Any


def _load_data(source: str | os.PathLike | TrainData) -> TrainData:
    if all(hasattr(source, a) for a in ("train", "val", "tokenizer")):
        return source  # type: ignore[return-value]
    path = Path(source)  # type: ignore[arg-type]
    if path.is_dir() and ((path / CONFIG_FILE).is_file() or (path / RUN_LATEST).exists()
                          or (path / METRICS_FILE).is_file()):
        raise DataError(f"--data {path} is a training run or checkpoint folder, not prepared "
                        f"data; pass the folder written by 'tinylm prepare --out' (the one "
                        f"this run was trained on)")
    return load_prepared(path)


def _data_name(data: TrainData) -> str:
    return str(getattr(data, "dir", "the training data"))


def _mask_of(data: TrainData, split: str) -> Any | None:
    mask = getattr(data, f"{split}_mask", None)
    if mask is not None and len(mask) != len(getattr(data, split)):
        raise DataError(f"the {split} loss mask has {len(mask):,} entries but the {split} "
                        f"split {len(getattr(data, split)):,} tokens; they must match")
    return mask


def _check_token_ids(data: TrainData, vocab_size: int) -> None:
    """Refuse ids outside the vocabulary (as eval does), scanning in chunks."""
    for split in ("train", "val"):
        arr = getattr(data, split)
        lo, hi = 0, -1
        for i in range(0, len(arr), 1 << 24):
            block = np.asarray(arr[i:i + (1 << 24)])
            lo, hi = min(lo, int(block.min())), max(hi, int(block.max()))
        if lo < 0 or hi >= vocab_size:
            bad = lo if lo < 0 else hi
            raise DataError(f"the {split} split of {_data_name(data)} holds token id {bad}, "
                            f"outside the vocabulary of {vocab_size}; the tokens were made "
                            f"with another tokenizer — prepare the data again with "
                            f"'tinylm prepare'")


def _draw_batch(tokens: Any, mask: Any | None, rows: int, C: int, gen: torch.Generator,
                ctx: distributed.DistContext, device: torch.device) -> tuple[Tensor, Tensor]:
    """This rank's (x, y) of one global batch; masked targets become -100 (ignored)."""
    if mask is None:
        x, y = get_batch(tokens, rows, C, gen, device)
        return ctx.shard(x), ctx.shard(y)  # (N·B, C) -> (B, C)
    starts = torch.randint(len(tokens) - C, (rows,), generator=gen).numpy()  # as get_batch
    idx = starts[:, None] + np.arange(C + 1)
    xy = ctx.shard(torch.from_numpy(np.asarray(tokens[idx]).astype(np.int64)))
    keep = ctx.shard(torch.from_numpy(np.asarray(mask[idx[:, 1:]]) != 0))
    if not bool(keep.any()):
        raise DataError("a training batch has no target with loss mask 1 (every position "
                        "is masked out); check the data's loss mask")
    y = xy[:, 1:].masked_fill(~keep, -100)
    return xy[:, :-1].contiguous().to(device), y.contiguous().to(device)


# --- the run state --------------------------------------------------------------------------


def _existing_step(latest: Path) -> int | None:
    try:
        return int(json.loads((latest / STATE_JSON_FILE).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _check_model_config(given: ModelConfig, saved: ModelConfig, where: Path) -> None:
    a, b = given.to_dict(), saved.to_dict()
    diff = [k for k in a if a[k] != b[k]]
    if diff:
        pairs = ", ".join(f"{k}={a[k]!r} (saved {b[k]!r})" for k in diff)
        raise ConfigError(f"--resume: the model config differs from the run in {where}: "
                          f"{pairs}; drop those flags or start a new --out")


def _maybe_compile(model: nn.Module, enabled: bool, sample: tuple[Tensor, Tensor],
                   amp: Any) -> nn.Module:
    """torch.compile ``model``, proven on one forward/backward; on failure warn and
    return the eager model (e.g. no C++ compiler, unsupported platform)."""
    if not enabled:
        return model
    try:
        compiled = torch.compile(model)
        x, y = sample
        with amp:
            loss = lm_loss(compiled(x), y)
        loss.backward()
        return compiled
    except Exception as exc:  # torch.compile fails in many backend-specific ways
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("torch.compile is not usable here (%s); training without --compile",
                    first[:200])
        with contextlib.suppress(Exception):
            torch._dynamo.reset()
        return model
    finally:
        for p in model.parameters():
            p.grad = None


def resume_mode(resume: bool | str | None) -> bool | str:
    """True, False or "auto"; None means "auto" when torchrun reports a restart
    (TORCHELASTIC_RESTART_COUNT > 0), else False."""
    if resume is None:
        try:
            restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
        except ValueError:
            restarts = 0
        return "auto" if restarts > 0 else False
    if resume in (True, False, "auto"):
        return resume
    raise ConfigError(f"resume must be True, False or 'auto', got {resume!r}")


@dataclass
class _Found:
    """What an earlier run left in the run folder (decided once, before building)."""

    resuming: bool
    step: int | None = None
    meta: dict[str, Any] | None = None


def _earlier_traces(out: Path) -> list[str]:
    names = [METRICS_FILE, RUN_CONFIG_FILE, RUN_BEST]
    return [n for n in names if (out / n).exists()]


def _find_run(out: Path, resume: bool | str, ctx: distributed.DistContext) -> _Found:
    """The restore decision: what is in ``out`` and whether this call continues it."""
    latest = out / RUN_LATEST
    if ctx.is_main:
        recover_checkpoint(latest)  # an interrupted save's complete copy wins
        recover_checkpoint(out / RUN_BEST)
        _remove_stale_files(out)
    distributed.barrier(ctx)
    step = _existing_step(latest) if latest.is_dir() else None
    if latest.is_dir() and step is None:
        raise CheckpointError(f"{latest} has no readable {STATE_JSON_FILE}; it cannot be "
                              f"resumed — move it away or choose another --out")
    if step is not None and not resume:
        raise CheckpointError(f"{out} already holds a training run (latest checkpoint at "
                              f"step {step}); pass --resume to continue it or choose a new "
                              f"--out")
    traces = _earlier_traces(out)
    if step is None and is_complete(out / RUN_BEST):  # never overwrite an earlier best/
        raise CheckpointError(f"{out} holds best/ of an earlier run but no latest/ checkpoint "
                              f"to resume, and a new run would overwrite best/; use "
                              f"{out / RUN_BEST} where a model is wanted, or choose a new "
                              f"--out")
    if step is None and resume is True:
        found = f"; it holds {', '.join(traces)} of a run stopped before its first save" \
            if traces else ""
        raise CheckpointError(f"--resume: no checkpoint in {out} (looked for {latest}/"
                              f"{STATE_JSON_FILE} and interrupted saves .{RUN_LATEST}.tmp-*/"
                              f".{RUN_LATEST}.old-*){found}; check --out, or drop --resume "
                              f"(or use --resume auto) to start a new run")
    if step is None:
        if traces and ctx.is_main:
            log.info("%s holds %s but no checkpoint (the earlier run stopped before its "
                     "first save); starting a new run", out, ", ".join(traces))
        return _Found(False)
    _tensors, meta = load_train_state(latest)
    return _Found(True, step, meta)


def _remove_stale_files(out: Path) -> None:
    """Temporaries of small writes a killed run left (we hold the lock: none is live)."""
    names = (f".{METRICS_FILE}.tmp-", f".{RUN_CONFIG_FILE}.tmp-", f".{PLOT_FILE}.tmp-",
             ".write-test-")
    for p in out.iterdir():
        if p.name.startswith(names) and p.is_file():
            with contextlib.suppress(OSError):
                p.unlink()


def _finished(found: _Found, cfg: TrainConfig) -> bool:
    """Whether the run being resumed already reached its end under ``cfg``."""
    meta = found.meta or {}
    if found.step is None or meta.get("stop_reason") not in ("max_steps", "time_budget"):
        return False
    if found.step >= cfg.max_steps:
        return True
    return (meta.get("stop_reason") == "time_budget" and cfg.time_budget is not None
            and float(meta.get("elapsed", 0.0)) >= cfg.time_budget)


@dataclass
class _Run:
    """Everything the phases of :func:`train` share: setup, then the mutable state."""

    cfg: TrainConfig
    ctx: distributed.DistContext
    device: torch.device
    out: Path
    data: TrainData
    raw: nn.Module
    model_run: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[Tensor]
    gen: torch.Generator
    amp: Any
    B: int
    C: int
    accum: int
    tokens_per_step: int
    eval_starts: np.ndarray
    extra: dict[str, Any]
    train_mask: Any | None = None
    val_mask: Any | None = None
    n_params: int = 0
    n_trainable: int = 0
    strategy: str = "ddp"  # how ranks share the work (single process: layout only)
    sharded: bool = False  # latest/ is a sharded checkpoint (zero1/fsdp)
    train_peak_rss: float | None = None  # bytes, measured when the training steps end
    # -- state (saved in latest/ and restored on resume) --
    step: int = 0
    best_val: float = math.inf
    elapsed0: float = 0.0
    interval_loss: Tensor | None = None
    interval_count: int = 0
    # -- this process only --
    resumed_from: int | None = None
    last_saved: int | None = None
    total_steps: float = 0.0
    lr: float = 0.0
    gnorm: Tensor | None = None
    pending_ok: list[Tensor] = field(default_factory=list)
    pending_from: int = 1
    t_start: float = 0.0
    t_mark: float = 0.0
    step_mark: int = 0
    start_step: int = 0
    eval_time: float = 0.0
    eval_total: float = 0.0
    stop_reason: str = "max_steps"
    final: bool = False
    peak_tok_s: float = 0.0
    intervals: int = 0
    slow_warned: bool = False
    final_val: float | None = None
    final_ppl: float | None = None
    metrics: _MetricsLog | None = None
    bar: _Progress | None = None
    stop: _StopSignal = field(default_factory=_StopSignal)

    @property
    def latest(self) -> Path:
        return self.out / RUN_LATEST

    @property
    def fsdp(self) -> bool:
        """Parameters sharded across ranks: evaluation is a collective of every rank."""
        return self.ctx.enabled and self.strategy == "fsdp"


# --- phase 1: restore (build the model, the optimizer, and the saved state) -------------------


def _build_model(model_config: ModelConfig, cfg: TrainConfig, data: TrainData,
                 found: _Found, model: nn.Module | None, out: Path) -> nn.Module:
    """The module to train: the saved one (resume), the given one, or a fresh GPT."""
    model_config = model_config.replace(vocab_size=data.tokenizer.vocab_size)
    latest = out / RUN_LATEST
    if found.resuming:
        check_same_tokenizer(load_tokenizer_of(latest), data.tokenizer, _data_name(data),
                             fix="resume with the data this run was trained on, or start "
                                 "a new --out")
        saved_config = ModelConfig.from_dict(read_config(latest)["model"])
        _check_model_config(model_config, saved_config, latest)
        if is_sharded(latest):  # the weights are filled from the shards after wrapping
            return build_model(read_config(latest)).train()
        return load_model(latest, device="cpu").train()
    if model is not None:
        raw = unwrap_model(model)
        if raw.config.vocab_size < data.tokenizer.vocab_size:
            raise ConfigError(f"the model's vocab_size {raw.config.vocab_size} is smaller "
                              f"than the data tokenizer's {data.tokenizer.vocab_size}; "
                              f"prepare the data with the model's tokenizer")
        return raw.train()
    torch.manual_seed(cfg.seed)
    return GPT(model_config)


def _setup(model_config: ModelConfig, cfg: TrainConfig, data: TrainData, out: Path,
           ctx: distributed.DistContext, found: _Found, model: nn.Module | None,
           extra: dict[str, Any]) -> _Run:
    """Build everything a run needs, in the order that keeps exact resume exact."""
    device = distributed.device_for(ctx, resolve_device(cfg.device))
    raw = _build_model(model_config, cfg, data, found, model, out)
    C = raw.config.context_length
    for split in ("train", "val"):
        n = len(getattr(data, split))
        if n < C + 1:
            raise DataError(f"the {split} split of {_data_name(data)} has {n:,} tokens, fewer "
                            f"than context_length + 1 = {C + 1:,}; use a smaller "
                            f"--context-length or prepare more text")
    _check_token_ids(data, raw.config.vocab_size)
    n_params = sum(p.numel() for p in raw.parameters())
    if ctx.is_main:
        preflight(out, n_params)
    distributed.barrier(ctx)
    raw.to(device)
    B, world = cfg.batch_size, ctx.world_size
    accum = _grad_accum(cfg, found, B, C, world)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
           else contextlib.nullcontext())
    model_run, optimizer = _apply_strategy(raw, cfg, ctx, device, data, amp)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ConfigError("the model has no parameter with requires_grad=True; nothing to "
                          "train")
    return _Run(cfg=cfg, ctx=ctx, device=device, out=out, data=data, raw=raw,
                model_run=model_run, optimizer=optimizer, params=params,
                gen=torch.Generator().manual_seed(cfg.seed), amp=amp, B=B, C=C, accum=accum,
                tokens_per_step=B * accum * world * C,
                eval_starts=sample_windows(len(data.val), C, cfg.eval_windows, cfg.seed),
                extra=extra, train_mask=_mask_of(data, "train"), val_mask=_mask_of(data, "val"),
                n_params=n_params, n_trainable=sum(p.numel() for p in params),
                strategy=cfg.strategy, sharded=cfg.strategy in ("zero1", "fsdp"),
                interval_loss=torch.zeros((), device=device),
                gnorm=torch.zeros((), device=device), lr=cfg.lr,
                total_steps=float(cfg.max_steps))


def _grad_accum(cfg: TrainConfig, found: _Found, B: int, C: int, world: int) -> int:
    """Micro-batches per step. Resuming with another number of ranks keeps the saved
    global batch (windows per step) by changing the accumulation: elastic resume."""
    meta = found.meta or {}
    saved_world = meta.get("world_size")
    if found.resuming and saved_world not in (None, world) and cfg.tokens_per_step is None:
        windows = int(meta["tokens_per_step"]) // C
        accum, rest = divmod(windows, B * world)
        if rest or accum < 1:
            raise ConfigError(f"--resume with {world} process(es): the run's global batch of "
                              f"{windows} windows (saved by {saved_world}) is not a multiple "
                              f"of batch_size {B} x {world} processes; resume with a number "
                              f"of processes (or a --batch-size) that divides it")
        return accum
    if cfg.tokens_per_step is not None:
        return max(1, round(cfg.tokens_per_step / (B * C * world)))
    return cfg.grad_accum


def _apply_strategy(raw: nn.Module, cfg: TrainConfig, ctx: distributed.DistContext,
                    device: torch.device, data: TrainData, amp: Any
                    ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(the module to run, the optimizer) under ``cfg.strategy``.

    The native fast paths (tinylm.native) step aside under fsdp: their eligibility
    would take the FSDP model for a plain GPT (FSDP2's class is a subclass of it) and
    read the DTensor shards as whole weights. So a sharded model is not accelerated,
    and its evaluations run with every fast path off (:func:`_fast_paths`)."""
    if not (ctx.enabled and cfg.strategy == "fsdp"):
        acceleration.accelerate(raw, device)  # the fast paths, decided once (tinylm.native)
    model_run = distributed.wrap_model(raw, ctx, device, cfg.strategy)
    if cfg.compile:
        sample = get_batch(data.train, cfg.batch_size, raw.config.context_length,
                           torch.Generator().manual_seed(0), device)
        model_run = _maybe_compile(model_run, True, sample, amp)
    if ctx.enabled and cfg.strategy == "zero1":
        optimizer = distributed.zero_optimizer(*optimizer_recipe(raw, cfg, device), ctx)
    else:
        optimizer = build_optimizer(raw, cfg, device)
    return model_run, optimizer


def _restore(run: _Run, found: _Found) -> None:
    """Put the saved training state (optimizer, RNGs, counters) back, or seed a new run."""
    ctx, device = run.ctx, run.device
    if not found.resuming:
        torch.manual_seed(run.cfg.seed + 1 + ctx.rank)  # dropout masks differ per rank
        return
    tensors, meta = load_train_state(run.latest)
    _restore_weights_and_optimizer(run, tensors, meta)
    run.gen.set_state(tensors["rng.data"])
    key = f"rng.torch.{ctx.rank}"
    if key in tensors and meta.get("world_size") == ctx.world_size:
        torch.set_rng_state(tensors[key])
        if device.type == "cuda" and f"rng.cuda.{ctx.rank}" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{ctx.rank}"], device)
    else:
        log.warning("resuming with %d processes instead of %d: dropout masks are "
                    "reseeded, so the run is not bitwise identical", ctx.world_size,
                    meta.get("world_size"))
        torch.manual_seed(run.cfg.seed + 1 + ctx.rank + meta["step"])
    run.step = run.resumed_from = run.last_saved = int(meta["step"])
    sample = meta.get("eval_sample")
    if sample is None or sample == _eval_sample(run):
        run.best_val = float(meta.get("best_val_loss") or math.inf)
    else:
        log.warning("the periodic evaluation sample changed (eval_windows or seed); best/ "
                    "is chosen afresh from now on")
    run.elapsed0 = float(meta.get("elapsed", 0.0))
    run.interval_loss = tensors["interval_loss"].to(device)
    run.interval_count = int(meta.get("interval_count", 0))
    run.pending_from = run.step + 1


def _restore_weights_and_optimizer(run: _Run, tensors: dict[str, Tensor],
                                   meta: dict[str, Any]) -> None:
    """A sharded latest/ loads into any strategy and number of ranks (resharded as it is
    read); an ordinary one into ddp or one process (its optimizer state is whole)."""
    if is_sharded(run.latest):
        distributed.load_shards(run.raw, run.optimizer, run.latest / SHARDS_DIR, run.ctx)
        return
    if run.sharded and run.ctx.enabled:
        saved = (meta.get("strategy") or "ddp")
        raise ConfigError(f"--resume: {run.latest} is an unsharded checkpoint (strategy "
                          f"{saved}); resume it with --strategy {saved}, or with one process "
                          f"(which then writes a sharded checkpoint)")
    load_optimizer_state(run.optimizer, tensors, meta["optimizer"])


def _eval_sample(run: _Run) -> dict[str, Any]:
    return {"seed": run.cfg.seed, "windows": len(run.eval_starts), "context_length": run.C}


def _open_logs(run: _Run, resuming: bool, progress: bool | None) -> None:
    """run.toml (the effective configuration) and metrics.jsonl, on rank 0."""
    if run.ctx.is_main:
        atomic_write(run.out / RUN_CONFIG_FILE, to_toml({
            "model": {k: v for k, v in run.raw.config.to_dict().items() if k != "vocab_size"},
            "train": run.cfg.to_dict()}))
    run.metrics = _MetricsLog(run.out, run.ctx.is_main, run.step if resuming else None)
    run.bar = _Progress(run.ctx.is_main, progress)


def _announce(run: _Run) -> None:
    """The header (before the bar starts, so it never shares the bar's line)."""
    cfg, ctx = run.cfg, run.ctx
    if not ctx.is_main:
        return
    if run.resumed_from is not None:
        log.info("resuming from step %d (%s)", run.resumed_from, run.latest)
    frozen = run.n_params - run.n_trainable
    log.info("training %s parameters%s on %s (%d process%s), %s tokens/step, %d steps%s -> %s",
             f"{run.n_trainable:,}", f" ({frozen:,} frozen)" if frozen else "", run.device,
             ctx.world_size, "es" if ctx.world_size > 1 else "", f"{run.tokens_per_step:,}",
             cfg.max_steps, f" or {cfg.time_budget:g} s" if cfg.time_budget else "", run.out)
    if cfg.warmup_steps >= cfg.max_steps and cfg.time_budget is None:
        log.warning("the warm-up (warmup_steps %d) is as long as the run (max_steps %d): the "
                    "learning rate only ramps up and never reaches its cosine decay; lower "
                    "--warmup-steps", cfg.warmup_steps, cfg.max_steps)


# --- phase 2: step ---------------------------------------------------------------------------


def _train_step(run: _Run) -> None:
    """One optimizer step: accumulate ``accum`` micro-batches, clip, update."""
    cfg, ctx = run.cfg, run.ctx
    run.lr = lr_at(run.step, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                   total_steps=run.total_steps, min_lr_ratio=cfg.min_lr_ratio)
    set_lr(run.optimizer, run.lr)
    step_loss = torch.zeros((), device=run.device)
    for micro in range(run.accum):
        x, y = _draw_batch(run.data.train, run.train_mask, run.B * ctx.world_size, run.C,
                           run.gen, ctx, run.device)
        with distributed.gradient_sync(run.model_run, ctx, micro == run.accum - 1):
            with run.amp:
                loss = lm_loss(run.model_run(x), y)
            (loss / run.accum).backward()
        step_loss += loss.detach()
    clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    run.gnorm = distributed.full_tensor(torch.nn.utils.clip_grad_norm_(run.params, clip))
    run.pending_ok.append(torch.isfinite(step_loss) & torch.isfinite(run.gnorm))
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.interval_loss += step_loss / run.accum
    run.interval_count += 1
    run.step += 1
    run.bar.step()


def _check_finite(run: _Run) -> None:
    """Read the pending finiteness flags (one host sync); stop on the first bad step."""
    if not run.pending_ok:
        return
    ok = torch.stack(run.pending_ok).cpu()
    if not bool(ok.all()):
        bad = run.pending_from + int((~ok).nonzero()[0, 0])
        cfg = run.cfg
        if run.last_saved is not None:
            kept = f"the last good checkpoint {run.latest} (step {run.last_saved}) is kept"
            then = "then continue with --resume"
        else:
            kept, then = "no checkpoint had been written yet", "then start the run again"
        clip = "" if cfg.grad_clip > 0 else " or use --grad-clip 1"
        raise NonFiniteLossError(
            f"loss or gradient became non-finite (nan/inf) at step {bad}; training stopped "
            f"and {kept}; lower --lr (now {cfg.lr:g}) or raise --warmup-steps{clip}, {then}")
    run.pending_ok, run.pending_from = [], run.step + 1


def _control(run: _Run, now: float) -> bool:
    """Stop flags (agreed across ranks at log steps) and the time budget's schedule
    length; sets ``run.final``/``run.stop_reason``. Returns whether this is a log step."""
    cfg, ctx = run.cfg, run.ctx
    at_log = run.step % cfg.log_every == 0
    time_up = (cfg.time_budget is not None
               and run.elapsed0 + now - run.t_start >= cfg.time_budget)
    flags = [float(run.stop.received is not None), float(time_up)]
    if ctx.enabled:
        flags = distributed.all_reduce_max(flags, ctx) if at_log else [0.0, 0.0]
    interrupted, time_up = flags[0] > 0, flags[1] > 0
    if cfg.time_budget is not None and at_log:
        spent = run.elapsed0 + now - run.t_start
        busy = now - run.t_start - run.eval_total - run.eval_time
        per_step = busy / (run.step - run.start_step)
        if per_step > 0:
            est = run.step + max(0.0, cfg.time_budget - spent) / per_step
            run.total_steps = min(float(cfg.max_steps),
                                  distributed.broadcast_floats([est], ctx)[0])
            run.bar.set_total(int(run.total_steps))
    run.final = run.step >= cfg.max_steps or time_up or interrupted
    if run.final:
        run.stop_reason = ("interrupted" if interrupted else
                           "time_budget" if time_up else "max_steps")
    return at_log


# --- phase 3: log ----------------------------------------------------------------------------


def _log_phase(run: _Run, now: float, at_log: bool) -> dict[str, Any]:
    """The train record of a log step (mean loss over ranks and steps since the last)."""
    if not (at_log or (run.final and run.interval_count)):
        return {}
    _check_finite(run)
    total = distributed.all_reduce_mean(run.interval_loss, run.ctx)
    mean_loss = total.item() / max(1, run.interval_count)
    dt = now - run.t_mark - run.eval_time
    steps = run.step - run.step_mark
    tok_s = steps * run.tokens_per_step / dt if dt > 0 else 0.0
    record = {"step": run.step, "train_loss": mean_loss, "lr": run.lr,
              "grad_norm": run.gnorm.item(), "tokens_per_s": tok_s}
    eta = (run.total_steps - run.step) * dt / max(1, steps)
    # a time budget's total is an estimate: never show step > total
    shown = run.step if run.final else max(run.step, int(run.total_steps))
    run.bar.report(run.step, shown, mean_loss, run.lr, tok_s, max(0.0, eta))
    _watch_throughput(run, tok_s)
    run.interval_loss.zero_()
    run.interval_count = 0
    run.t_mark, run.step_mark = now, run.step
    run.eval_total, run.eval_time = run.eval_total + run.eval_time, 0.0
    return record


def _watch_throughput(run: _Run, tok_s: float) -> None:
    """Say once when tokens/s falls below a quarter of this run's own earlier rate."""
    run.intervals += 1
    if run.intervals <= 2 or tok_s <= 0:  # the first intervals include warm-up costs
        return
    if run.peak_tok_s and tok_s < run.peak_tok_s / 4 and not run.slow_warned:
        run.slow_warned = True
        cpus = available_cpus()
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        run.bar.message(
            f"throughput fell to {tok_s:,.0f} tokens/s from {run.peak_tok_s:,.0f} earlier in "
            f"this run; the machine is probably busy (load average {load:.1f} on {cpus} "
            f"CPUs, {torch.get_num_threads()} threads here): stop the other jobs or use "
            f"fewer threads (--threads 1)", logging.WARNING)
    run.peak_tok_s = max(run.peak_tok_s, tok_s)


# --- phase 4: evaluate -----------------------------------------------------------------------


def _eval_model(run: _Run) -> nn.Module | None:
    """The module this rank evaluates (None: this rank does not): rank 0's model, or
    under fsdp the sharded model on every rank (a collective forward; each rank gets the
    same result)."""
    return run.raw if run.ctx.is_main or run.fsdp else None


@contextlib.contextmanager
def _fast_paths(run: _Run) -> Iterator[None]:
    """Evaluation under fsdp: every fast path off, the root's parameters gathered."""
    if not run.fsdp:
        yield
        return
    with acceleration.disabled(), distributed.root_unsharded(run.raw):
        yield


def _estimate(run: _Run, model: nn.Module) -> tuple[float, float]:
    """The periodic validation estimate: the fixed random sample of windows."""
    _check_finite(run)
    with _fast_paths(run):
        r = estimate_loss(model, run.data.val, run.eval_starts, context_length=run.C,
                          batch_size=2 * run.B, loss_mask=run.val_mask)
    run.raw.train()
    if run.fsdp:  # every rank computed it; rank 0's value decides best/ everywhere
        loss = distributed.broadcast_floats([r.loss], run.ctx)[0]
        return loss, perplexity(loss)
    return r.loss, r.perplexity


def _keep_if_best(run: _Run, estimate: float, model: nn.Module) -> None:
    """best/ follows the lowest estimate (always the same sample: like for like)."""
    if estimate < run.best_val:
        run.best_val = estimate
        # under fsdp every rank gathers (a collective), rank 0 gets the whole weights
        state = distributed.full_model_state(run.raw, run.ctx) if run.fsdp else None
        if run.ctx.is_main:
            save_checkpoint(run.out / RUN_BEST, model, run.data.tokenizer, state=state,
                            extra_config={**run.extra, "best": {
                                "step": run.step, "val_loss_estimate": estimate,
                                "eval_windows": len(run.eval_starts)}})


def _eval_phase(run: _Run, record: dict[str, Any]) -> None:
    if run.step % run.cfg.eval_every or run.final:
        return
    t0 = time.perf_counter()
    model = _eval_model(run)
    if model is not None:
        val, ppl = _estimate(run, model)
        _keep_if_best(run, val, model)
        record.update(step=run.step, lr=run.lr, val_loss_estimate=val, val_ppl_estimate=ppl,
                      val_windows=len(run.eval_starts))
        run.bar.message(f"step {run.step}: val loss {val:.4f} (ppl {ppl:.2f}, estimate on "
                        f"{len(run.eval_starts)} windows)")
    run.eval_time += time.perf_counter() - t0


def _write_record(run: _Run, record: dict[str, Any]) -> None:
    if not record:
        return
    record["elapsed"] = run.elapsed0 + time.perf_counter() - run.t_start
    run.metrics.write(record)
    if "val_loss_estimate" in record and run.ctx.is_main:
        _redraw(run)


def _redraw(run: _Run) -> None:
    """Redraw OUT/loss.png; a missing matplotlib only costs the picture (said once)."""
    try:
        plot_losses([(run.out.resolve().name, run.metrics.records)], run.out / PLOT_FILE,
                    log_scale=run.cfg.plot_log_scale)
    except TinyLMError as exc:
        if not getattr(run, "_plot_warned", False):
            run._plot_warned = True  # type: ignore[attr-defined]
            log.warning("loss.png not drawn: %s", exc)


# --- phase 5: save ---------------------------------------------------------------------------


def _save_latest(run: _Run) -> None:
    """Write OUT/latest: weights, optimizer, every rank's RNG, counters (rank 0 writes;
    under zero1/fsdp every rank writes its shard of the weights and optimizer state)."""
    ctx, device = run.ctx, run.device
    _check_finite(run)
    tensors, opt_meta = ({}, {"sharded": True}) if run.sharded else \
        optimizer_state(run.optimizer)
    tensors["rng.data"] = run.gen.get_state()
    for r, t in enumerate(distributed.all_gather_bytes(torch.get_rng_state(), ctx)):
        tensors[f"rng.torch.{r}"] = t
    if device.type == "cuda":
        states = distributed.all_gather_bytes(torch.cuda.get_rng_state(device), ctx)
        for r, t in enumerate(states):
            tensors[f"rng.cuda.{r}"] = t
    tensors["interval_loss"] = run.interval_loss.detach().cpu().reshape(())
    meta = {"step": run.step, "best_val_loss": run.best_val if math.isfinite(run.best_val)
            else None, "elapsed": run.elapsed0 + (time.perf_counter() - run.t_start),
            "interval_count": run.interval_count, "world_size": ctx.world_size,
            "strategy": run.strategy, "grad_accum": run.accum,
            "tokens_per_step": run.tokens_per_step,
            "tokens_seen": run.step * run.tokens_per_step, "optimizer": opt_meta,
            "eval_sample": _eval_sample(run),
            "stop_reason": run.stop_reason if run.final else None,
            "final_val_loss": run.final_val, "memory": _memory(run),
            "data_position": {"generator": "rng.data",
                              "windows_drawn": run.step * run.accum * run.B * ctx.world_size}}
    if run.sharded:
        _save_sharded(run, tensors, meta)
    elif ctx.is_main:
        save_checkpoint(run.latest, run.raw, run.data.tokenizer, extra_config=run.extra,
                        train_tensors=tensors, train_meta=meta)
    run.last_saved = run.step


def _save_sharded(run: _Run, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """The save protocol with shards: rank 0 makes the temporary folder, every rank
    writes its shard into it, then rank 0 adds the JSON (config.json last) and renames
    it into place. Until that rename the previous latest/ is the checkpoint."""
    ctx = run.ctx
    tmp = new_temporary(run.latest) if ctx.is_main else None
    tmp = Path(distributed.broadcast_text(str(tmp), ctx))
    try:
        distributed.save_shards(distributed.sharded_state(run.raw, run.optimizer),
                                tmp / SHARDS_DIR, ctx)
        distributed.barrier(ctx)
        if ctx.is_main:
            sharded = {"strategy": run.strategy, "world_size": ctx.world_size}
            save_checkpoint(run.latest, run.raw, run.data.tokenizer,
                            extra_config={**run.extra, "sharded": sharded},
                            train_tensors=tensors, train_meta=meta, tmp=tmp)
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    distributed.barrier(ctx)


def _memory(run: _Run) -> dict[str, list[float]]:
    """Per rank (MiB): the training state it holds (weights, gradients, optimizer state;
    a shard counts its local part) and the process's peak resident memory during the
    training steps (the final evaluation and best/ excluded)."""
    params = [p for p in run.raw.parameters()]
    grads = [p for p in params if p.requires_grad]  # a gradient per trainable parameter
    inner = distributed.local_optimizer(run.optimizer)
    moments = [v for st in inner.state.values() for v in st.values() if isinstance(v, Tensor)]
    mib = 1 / 2**20
    values = [distributed.local_bytes(params) * mib, distributed.local_bytes(grads) * mib,
              distributed.local_bytes(moments) * mib,
              (run.train_peak_rss or _peak_rss()) * mib]
    rows = distributed.all_gather_floats(values, run.ctx)
    names = ("weights_mib", "grads_mib", "optimizer_mib", "peak_rss_mib")
    return {name: [round(r[i], 3) for r in rows] for i, name in enumerate(names)}


def _peak_rss() -> float:
    """Bytes: the peak resident set size of this process (0 where unknown)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)


def _finish(run: _Run) -> float:
    """After the loop: like-for-like best/, the exact whole-split loss, the last save.
    Returns the training seconds without evaluation and saving."""
    train_time = time.perf_counter() - run.t_start
    pure_time = train_time - run.eval_total - run.eval_time
    run.bar.close()
    model = _eval_model(run) if run.stop_reason != "interrupted" else None
    if model is not None:
        estimate, _ = _estimate(run, model)
        _keep_if_best(run, estimate, model)
        with _fast_paths(run):
            r = _final_eval(run, model)
        run.raw.train()
        run.final_val, run.final_ppl = r.loss, r.perplexity
        run.metrics.write({"step": run.step, "lr": run.lr, "val_loss": r.loss,
                           "val_ppl": r.perplexity, "val_loss_estimate": estimate,
                           "final": True,
                           "elapsed": run.elapsed0 + time.perf_counter() - run.t_start})
        if run.ctx.is_main:
            _redraw(run)
    _save_latest(run)
    distributed.barrier(run.ctx)
    return pure_time


def _final_eval(run: _Run, model: nn.Module) -> Any:
    """The exact loss over the whole validation split (masked: over every window)."""
    if run.val_mask is None:
        return evaluate(model, run.data.val, context_length=run.C, batch_size=2 * run.B)
    every = sample_windows(len(run.data.val), run.C, None, run.cfg.seed)
    return estimate_loss(model, run.data.val, every, context_length=run.C,
                         batch_size=2 * run.B, loss_mask=run.val_mask)


def _loop(run: _Run, on_step: Callable[[int], None] | None) -> TrainResult:
    """Step, evaluate, log and save until the run's end; then finish."""
    cfg = run.cfg
    with run.stop.installed(), contextlib.closing(run.metrics), contextlib.closing(run.bar):
        _announce(run)
        run.bar.open(run.step, cfg.max_steps)
        run.t_start = run.t_mark = time.perf_counter()
        run.step_mark = run.start_step = run.step
        while True:
            _train_step(run)
            if on_step is not None:
                on_step(run.step)
            now = time.perf_counter()
            at_log = _control(run, now)
            record = _log_phase(run, now, at_log)
            _eval_phase(run, record)
            _write_record(run, record)
            if run.final:
                break
            if run.step % cfg.save_every == 0:
                t0 = time.perf_counter()
                _save_latest(run)
                run.eval_time += time.perf_counter() - t0
        run.train_peak_rss = _peak_rss()  # before the final evaluation and best/
        pure_time = _finish(run)
    trained = run.step - (run.resumed_from or 0)
    return TrainResult(
        out_dir=run.out, steps=run.step, final_val_loss=run.final_val,
        final_val_perplexity=run.final_ppl,
        best_val_loss=run.best_val if math.isfinite(run.best_val) else None,
        tokens_per_s=trained * run.tokens_per_step / pure_time if pure_time > 0 else 0.0,
        elapsed=run.elapsed0 + time.perf_counter() - run.t_start,
        stop_reason=run.stop_reason, rank=run.ctx.rank, resumed_from=run.resumed_from)


def _finished_result(out: Path, found: _Found, cfg: TrainConfig,
                     ctx: distributed.DistContext) -> TrainResult:
    meta = found.meta or {}
    if ctx.is_main:  # the CLI prints its own line from the result
        log.debug("%s is already finished at step %d (%s); nothing was changed", out,
                  found.step, meta.get("stop_reason"))
    final = meta.get("final_val_loss")
    return TrainResult(out_dir=out, steps=int(found.step or 0), final_val_loss=final,
                       final_val_perplexity=perplexity(final) if final is not None else None,
                       best_val_loss=meta.get("best_val_loss"), tokens_per_s=0.0,
                       elapsed=float(meta.get("elapsed", 0.0)), stop_reason="finished",
                       rank=ctx.rank, resumed_from=found.step)


# --- the entry points --------------------------------------------------------------------------


def train(
    model_config: ModelConfig,
    train_config: TrainConfig,
    data_dir: str | os.PathLike | TrainData,
    out_dir: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    resume: bool | str | None = False,
    progress: bool | None = None,
    on_step: Callable[[int], None] | None = None,
    extra_config: dict[str, Any] | None = None,
    model_tokenizer: Any | None = None,
) -> TrainResult:
    """Train a GPT on ``data_dir`` (a ``tinylm prepare`` folder, or any :class:`TrainData`
    object, e.g. with a loss mask); write the run to ``out_dir``.

    ``model_config.vocab_size`` is replaced by the data tokenizer's size. ``model``
    trains an existing module instead of a fresh ``GPT(model_config)`` (e.g. a
    factorised one from tinylm.layers.lowrank, or one with LoRA adapters); only its parameters
    with ``requires_grad=True`` are trained, and its structure is recorded in the
    checkpoint (plus ``extra_config`` entries in config.json). ``resume``: False (an
    existing run in ``out_dir`` is an error, never overwritten), True (continue from
    ``out_dir/latest``; none there is an error that says what was looked for), "auto"
    (continue if there is a checkpoint, else start), None ("auto" under a torchrun
    restart, else False). ``progress``: True for a tqdm bar, False for log lines, None
    to pick by terminal. ``on_step(step)`` runs after every optimizer step.
    ``model_tokenizer`` (the tokenizer ``model`` was trained with) is compared with the
    data's by content hash, as resume does (fine-tuning on mismatched data is refused).

    The run folder is locked for the call (a second writer is refused with this
    process's pid). Under torchrun, every rank calls this; rank 0 writes all files.
    """
    cfg = train_config
    out = Path(out_dir)
    data = _load_data(data_dir)
    check_same_tokenizer(model_tokenizer, data.tokenizer, _data_name(data),
                         fix="prepare the data with the model's tokenizer (tinylm prepare "
                             "--tokenizer MODEL_DIR/tokenizer.json)")
    ctx = distributed.init_from_env(resolve_device(cfg.device).type)
    lock = None
    try:
        if ctx.is_main:
            _prepare_out(out)
            lock = FolderLock(out).acquire()
        with using_threads(cfg.threads):
            found = _find_run(out, resume_mode(resume), ctx)
            if found.resuming:
                saved = ModelConfig.from_dict(read_config(out / RUN_LATEST)["model"])
                given = model_config.replace(vocab_size=saved.vocab_size)
                _check_model_config(given, saved, out / RUN_LATEST)
            if found.resuming and _finished(found, cfg):
                return _finished_result(out, found, cfg, ctx)
            extra = {**(extra_config or {}), "train": cfg.to_dict()}
            run = _setup(model_config, cfg, data, out, ctx, found, model, extra)
            _restore(run, found)
            _open_logs(run, found.resuming, progress)
            return _loop(run, on_step)
    finally:
        if lock is not None:
            lock.release()
        distributed.shutdown(ctx)


@contextlib.contextmanager
def using_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to ``n`` for the block (None: left as they are)."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n is not None:
            torch.set_num_threads(before)


def command_threads(n: int | None) -> contextlib.AbstractContextManager[None]:
    """What a ``tinylm`` command runs under: ``n`` threads, or
    :func:`tinylm.core.config.default_threads` (the free cores) when ``n`` is None."""
    return using_threads(n if n is not None else default_threads())


def layer_configs(out_dir: str | os.PathLike, *, config_file: str | os.PathLike | None = None,
                  overrides: dict[str, Any] | None = None,
                  resume: bool | str | None = False, arch: str | None = None
                  ) -> tuple[ModelConfig, TrainConfig]:
    """The configuration layering rule of ``tinylm train``: defaults, then the ``arch``
    preset (``tinylm.core.config.ARCH_PRESETS``), then the saved run
    (when resuming and OUT/latest exists), then the ``config_file`` TOML, then
    ``overrides`` (flags; a value of None there means "not given"; :data:`UNSET` means
    "switch off", e.g. ``--time-budget 0``). vocab_size always comes from the data."""
    model_kw: dict[str, Any] = resolve_arch(arch, {})  # every later layer overrides it
    train_kw: dict[str, Any] = {}
    latest = Path(out_dir) / RUN_LATEST
    if resume_mode(resume) and Path(out_dir).is_dir():
        recover_checkpoint(latest)
        if (latest / CONFIG_FILE).is_file():
            saved = read_config(latest)
            model_kw.update(saved["model"])
            train_kw.update(saved.get("train", {}))
    if config_file:
        m, t = read_toml(config_file)
        model_kw.update(m)
        train_kw.update(t)
    names = {"model": {f.name for f in fields(ModelConfig)},
             "train": {f.name for f in fields(TrainConfig)}}
    for key, value in (overrides or {}).items():
        if value is None:
            continue
        kw = model_kw if key in names["model"] else train_kw
        kw[key] = None if value is UNSET else value
    model_kw.pop("vocab_size", None)
    return ModelConfig.from_dict(model_kw), TrainConfig.from_dict(train_kw)


#: An override meaning "switch this optional setting off" (``--time-budget 0`` / ``none``).
UNSET = object()


def train_run(data_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
              config_file: str | os.PathLike | None = None,
              overrides: dict[str, Any] | None = None, resume: bool | str | None = None,
              progress: bool | None = None, arch: str | None = None) -> TrainResult:
    """``tinylm train``: :func:`layer_configs`, then :func:`train`, with ``threads``
    defaulting to :func:`tinylm.core.config.default_threads` when no layer sets it."""
    model_config, train_config = layer_configs(out_dir, config_file=config_file,
                                               overrides=overrides, resume=resume, arch=arch)
    with command_threads(train_config.threads):
        return train(model_config, train_config, data_dir, out_dir, resume=resume,
                     progress=progress)


# --- sharded checkpoints: consolidation ------------------------------------------------------

_STRUCTURE_SECTIONS = ("format", "version", "model", "sharded", *STRUCTURE_SECTIONS)


def export_checkpoint(source: str | os.PathLike, out: str | os.PathLike, *,
                      force: bool = False) -> Path:
    """``tinylm export-checkpoint``: a sharded checkpoint (``--strategy zero1|fsdp``, or a
    run folder whose latest/ is one) -> the ordinary safetensors + JSON checkpoint that
    every command reads, with its whole optimizer state (resumable with ``--strategy
    ddp`` or one process). Reads the shards in this one process, no process group."""
    folder = resolve_checkpoint_dir(source)
    if not is_complete(folder):
        raise CheckpointError(f"{folder} is not a complete tinylm checkpoint; pass a "
                              f"checkpoint folder or a tinylm train --out folder")
    if not is_sharded(folder):
        raise CheckpointError(f"{folder} is already an ordinary checkpoint; every command "
                              f"reads it as it is (nothing was written)")
    dest = check_target(out, force=force)
    config = read_config(folder)
    model = build_model(config)
    train_cfg = TrainConfig.from_dict({**config.get("train", {}), "strategy": "ddp"})
    optimizer = build_optimizer(model, train_cfg, torch.device("cpu"))
    distributed.load_shards(model, optimizer, folder / SHARDS_DIR, distributed.DistContext())
    tensors, meta = load_train_state(folder)
    opt_tensors, opt_meta = optimizer_state(optimizer)
    tensors.update(opt_tensors)
    meta.update(optimizer=opt_meta, strategy="ddp",
                exported_from={**config["sharded"], "step": meta.get("step")})
    extra = {k: v for k, v in config.items() if k not in _STRUCTURE_SECTIONS}
    extra["train"] = train_cfg.to_dict()
    return save_checkpoint(dest, model, load_tokenizer_of(folder), extra_config=extra,
                           train_tensors=tensors, train_meta=meta)
