"""The training loop: schedule, accumulation, clipping, evaluation, checkpoints, metrics.

``train(model_config, train_config, data_dir, out_dir)`` turns a prepared data folder
into a run folder::

    OUT/latest/       the newest checkpoint (model, config, tokenizer, training state)
    OUT/best/         the checkpoint with the lowest validation loss so far
    OUT/metrics.jsonl one JSON object per logged step (train loss, val loss, lr, ...)
    OUT/loss.png      train and val loss vs step, redrawn at each evaluation
    OUT/run.toml      the effective configuration (reusable with --config)

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tinylm import acceleration, distributed
from tinylm.checkpoint import (
    RUN_LATEST,
    load_model,
    load_optimizer_state,
    load_train_state,
    optimizer_state,
    read_config,
    save_checkpoint,
    unwrap_model,
)
from tinylm.config import ModelConfig, TrainConfig, resolve_device, to_toml
from tinylm.errors import CheckpointError, ConfigError, DataError, TinyLMError
from tinylm.model import GPT, lm_loss

log = logging.getLogger(__name__)

RUN_BEST = "best"
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


def build_optimizer(model: nn.Module, config: TrainConfig,
                    device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by ``config.optimizer`` over ``model``'s parameters.

    "adamw": torch AdamW (fused kernel where the device supports it) on
    :func:`decay_groups`. "muon": :class:`MuonAdamW`, Muon on the decayed weight
    matrices and AdamW on the rest (reaches a given loss in ~3× fewer steps on tiny
    Shakespeare; see BENCHMARKS.md). Add new choices here and to config.OPTIMIZERS.
    """
    groups = decay_groups(model, config.weight_decay)
    fused = device.type in ("cuda", "cpu")
    if config.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2),
                                 fused=fused)
    if config.optimizer == "muon":
        groups[0]["muon"] = True  # the decayed 2-D weight matrices
        return MuonAdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2),
                         fused=fused)
    raise ConfigError(f"unknown optimizer {config.optimizer!r}")  # config validates first


def newton_schulz(G: Tensor, steps: int = 5, eps: float = 1e-7) -> Tensor:
    """Approximately orthogonalise a matrix (M, N): U·Vᵀ of its SVD, singular values ~1.

    The quintic Newton–Schulz iteration of Muon (Keller Jordan), with its coefficients
    (3.4445, -4.775, 2.0315), as in ``torch.optim.Muon`` — but in the input's dtype:
    torch's casts to bf16, which is slow and coarse on CPUs.
    """
    a, b, c = 3.4445, -4.775, 2.0315
    X = G / (G.norm() + eps)  # spectral norm <= Frobenius norm <= 1
    wide = X.shape[0] <= X.shape[1]
    X = X if wide else X.T  # (M, N) -> (min, max): the Gram matrix is the small one
    for _ in range(steps):
        A = X @ X.T  # (min, min)
        X = a * X + (b * A + c * (A @ A)) @ X
    return X if wide else X.T


class MuonAdamW(torch.optim.AdamW):
    """Muon for the parameter groups marked ``muon=True`` (2-D weight matrices), AdamW
    for the others (embeddings, biases, LayerNorm gains), as one optimizer.

    Muon step for a matrix W (out, in) with gradient G: momentum buffer
    M ← μ·M + (1-μ)·G, Nesterov update U = (1-μ)·G + μ·M (torch.optim.Muon's form),
    W ← W·(1 - η·λ) - η·√max(1, out/in)·NS(U) with η = ``muon_lr_ratio`` × the group's lr.
    One lr drives both parts, so the warm-up/cosine schedule of :func:`train` applies
    unchanged; the state is an ordinary ``state_dict`` (checkpoints and resume work).
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
            if not group["muon"]:
                continue
            lr, mu = group["lr"] * group["muon_lr_ratio"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:  # "step" too: AdamW's loader expects it
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    state["momentum_buffer"] = torch.zeros_like(p)
                state["step"] += 1
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                update = newton_schulz(p.grad.lerp(buf, mu), group["ns_steps"])
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * math.sqrt(max(1.0, p.shape[0] / p.shape[1])))
        return loss


# --- results ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainResult:
    """What a call to :func:`train` achieved.

    ``final_val_loss`` is over the whole validation split (None when interrupted);
    ``best_val_loss`` the lowest loss of any evaluation (periodic ones use
    ``eval_windows`` windows). ``tokens_per_s`` counts training tokens of all ranks
    over training time (evaluation and saving excluded). ``stop_reason`` is
    "max_steps", "time_budget" or "interrupted".
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
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def plot_losses(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], out: str | os.PathLike,
                *, log_scale: bool = False, title: str | None = None) -> Path:
    """Draw train loss (lines) and val loss (dots) vs step for each (label, records).

    Written atomically to ``out`` (PNG). Uses matplotlib's Agg canvas directly, so it
    never touches a display or pyplot's global state.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("plotting needs matplotlib; pip install 'tinylm[plot]'") from exc
    fig = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    colors = [f"C{i}" for i in range(10)]
    for i, (label, records) in enumerate(runs):
        color = colors[i % len(colors)]
        tr = [(r["step"], r["train_loss"]) for r in records if r.get("train_loss") is not None]
        va = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
        if tr:
            ax.plot(*zip(*tr, strict=True), color=color, alpha=0.6, lw=1,
                    label=f"{label} train")
        if va:
            ax.plot(*zip(*va, strict=True), color=color, marker="o", ms=3, lw=1.5,
                    label=f"{label} val")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if log_scale:
        ax.set_yscale("log")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, format="png", bbox_inches="tight")
    os.replace(tmp, out)
    return out


def plot_runs(run_dirs: Sequence[str | os.PathLike], out: str | os.PathLike, *,
              log_scale: bool = False) -> Path:
    """One figure comparing the loss curves of several run folders (``tinylm plot``)."""
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
        text = "".join(json.dumps(r) + "\n" for r in self.records)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self.enabled:
            self._file.close()


# --- progress display ---------------------------------------------------------------------


def _fmt_seconds(s: float) -> str:
    s = max(0, int(s))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


class _Progress:
    """A tqdm bar on a terminal, plain log lines otherwise (e.g. in CI)."""

    def __init__(self, enabled: bool, use_bar: bool | None, start: int, total: int) -> None:
        self.enabled = enabled
        if use_bar is None:
            use_bar = sys.stderr.isatty()
        self.bar = None
        if enabled and use_bar:
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

    def message(self, text: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            log.info("%s", text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


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


def preflight(out: Path, n_params: int) -> None:
    """Fail before training when ``out`` cannot hold the run's checkpoints.

    Checks that the folder can be created and written, and that the free space covers
    latest/ (weights + two AdamW moments), best/ and one temporary copy during a save.
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
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


# --- the loop -----------------------------------------------------------------------------


def _existing_step(latest: Path) -> int | None:
    try:
        return int(json.loads((latest / "train_state.json").read_text())["step"])
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


def train(
    model_config: ModelConfig,
    train_config: TrainConfig,
    data_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    model: nn.Module | None = None,
    resume: bool = False,
    progress: bool | None = None,
    on_step: Callable[[int], None] | None = None,
) -> TrainResult:
    """Train a GPT on the prepared data in ``data_dir``; write the run to ``out_dir``.

    ``model_config.vocab_size`` is replaced by the data tokenizer's size. ``model``
    trains an existing module instead of a fresh ``GPT(model_config)`` (e.g. a
    factorised one from tinylm.lowrank); its structure is recorded in the checkpoint.
    ``resume`` continues from ``out_dir/latest`` (a fresh start when there is none);
    without it an existing run in ``out_dir`` is an error, never overwritten.
    ``progress``: True for a tqdm bar, False for log lines, None to pick by TTY.
    ``on_step(step)`` is called after every optimizer step (tests, custom stopping).

    Under torchrun, every rank calls this; rank 0 writes all files.
    """
    from tinylm.data import get_batch, load_prepared
    from tinylm.evaluation import evaluate

    cfg = train_config
    out = Path(out_dir)
    latest, best_dir = out / RUN_LATEST, out / RUN_BEST
    data = load_prepared(data_dir)
    base_device = resolve_device(cfg.device)
    ctx = distributed.init_from_env(base_device.type)
    try:
        device = distributed.device_for(ctx, base_device)
        saved_step = _existing_step(latest) if latest.is_dir() else None
        if latest.is_dir() and saved_step is None:
            raise CheckpointError(f"{latest} has no readable train_state.json; it cannot be "
                                  f"resumed — move it away or choose another --out")
        if saved_step is not None and not resume:
            raise CheckpointError(f"{out} already holds a training run (latest checkpoint at "
                                  f"step {saved_step}); pass --resume to continue it or choose "
                                  f"a new --out")
        resuming = resume and saved_step is not None
        if resume and not resuming and ctx.is_main:
            log.info("no checkpoint in %s yet; starting a new run", latest)

        # -- model --------------------------------------------------------------------
        model_config = model_config.replace(vocab_size=data.tokenizer.vocab_size)
        if resuming:
            saved_config = ModelConfig.from_dict(read_config(latest)["model"])
            _check_model_config(model_config, saved_config, latest)
            raw = load_model(latest, device="cpu").train()
        elif model is not None:
            raw = unwrap_model(model)
            model_config = raw.config
            if model_config.vocab_size < data.tokenizer.vocab_size:
                raise ConfigError(f"the model's vocab_size {model_config.vocab_size} is "
                                  f"smaller than the data tokenizer's "
                                  f"{data.tokenizer.vocab_size}; prepare the data with the "
                                  f"model's tokenizer")
            raw.train()
        else:
            torch.manual_seed(cfg.seed)
            raw = GPT(model_config)
        C = raw.config.context_length
        for split in ("train", "val"):
            n = len(getattr(data, split))
            if n < C + 1:
                raise DataError(f"the {split} split of {data.dir} has {n:,} tokens, fewer than "
                                f"context_length + 1 = {C + 1:,}; use a smaller "
                                f"--context-length or prepare more text")
        n_params = sum(p.numel() for p in raw.parameters())
        if ctx.is_main:
            preflight(out, n_params)
        distributed.barrier(ctx)
        raw.to(device)
        acceleration.accelerate(raw, device)  # the fast paths, decided once (tinylm.native)

        B, world = cfg.batch_size, ctx.world_size
        accum = cfg.grad_accum
        if cfg.tokens_per_step is not None:
            accum = max(1, round(cfg.tokens_per_step / (B * C * world)))
        tokens_per_step = B * accum * world * C
        amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
               else contextlib.nullcontext())

        model_run = distributed.wrap_model(raw, ctx, device)
        gen = torch.Generator().manual_seed(cfg.seed)
        if cfg.compile:
            sample = get_batch(data.train, B, C, torch.Generator().manual_seed(0), device)
            model_run = _maybe_compile(model_run, True, sample, amp)
        optimizer = build_optimizer(raw, cfg, device)
        params = [p for g in optimizer.param_groups for p in g["params"]]

        # -- state ----------------------------------------------------------------------
        step, best_val, elapsed0 = 0, math.inf, 0.0
        interval_loss = torch.zeros((), device=device)
        interval_count = 0
        if resuming:
            tensors, meta = load_train_state(latest)
            load_optimizer_state(optimizer, tensors, meta["optimizer"])
            gen.set_state(tensors["rng.data"])
            key = f"rng.torch.{ctx.rank}"
            if key in tensors and meta.get("world_size") == world:
                torch.set_rng_state(tensors[key])
                if device.type == "cuda" and f"rng.cuda.{ctx.rank}" in tensors:
                    torch.cuda.set_rng_state(tensors[f"rng.cuda.{ctx.rank}"], device)
            else:
                log.warning("resuming with %d processes instead of %d: dropout masks are "
                            "reseeded, so the run is not bitwise identical", world,
                            meta.get("world_size"))
                torch.manual_seed(cfg.seed + 1 + ctx.rank + meta["step"])
            step = int(meta["step"])
            best_val = float(meta.get("best_val_loss") or math.inf)
            elapsed0 = float(meta.get("elapsed", 0.0))
            interval_loss = tensors["interval_loss"].to(device)
            interval_count = int(meta.get("interval_count", 0))
        else:
            torch.manual_seed(cfg.seed + 1 + ctx.rank)  # dropout masks differ per rank

        extra = {"train": cfg.to_dict()}
        if ctx.is_main:
            (out / RUN_CONFIG_FILE).write_text(
                to_toml({"model": {k: v for k, v in raw.config.to_dict().items()
                                   if k != "vocab_size"}, "train": cfg.to_dict()}),
                encoding="utf-8")
        metrics = _MetricsLog(out, ctx.is_main, step if resuming else None)
        total_steps: float = cfg.max_steps
        bar = _Progress(ctx.is_main, progress, step, cfg.max_steps)
        stop = _StopSignal()
        pending_ok: list[Tensor] = []
        pending_from = step + 1
        last_saved = saved_step if resuming else None

        def check_finite() -> None:
            nonlocal pending_ok, pending_from
            if not pending_ok:
                return
            ok = torch.stack(pending_ok).cpu()
            if not bool(ok.all()):
                bad = pending_from + int((~ok).nonzero()[0, 0])
                kept = (f"the last good checkpoint {latest} (step {last_saved}) is kept"
                        if last_saved is not None else "no checkpoint had been written yet")
                raise NonFiniteLossError(
                    f"loss or gradient became non-finite (nan/inf) at step {bad}; training "
                    f"stopped and {kept}; lower --lr (now {cfg.lr:g}), raise --warmup-steps "
                    f"or use --grad-clip, then continue with --resume")
            pending_ok, pending_from = [], step + 1

        def run_eval(max_windows: int | None) -> tuple[float, float]:
            nonlocal best_val
            check_finite()
            r = evaluate(raw, data.val, context_length=C, batch_size=2 * B,
                         max_windows=max_windows)
            raw.train()
            if r.loss < best_val:
                best_val = r.loss
                save_checkpoint(best_dir, raw, data.tokenizer, extra_config={
                    **extra, "best": {"step": step, "val_loss": r.loss}})
            return r.loss, r.perplexity

        def save_latest() -> None:
            nonlocal last_saved
            check_finite()
            tensors, opt_meta = optimizer_state(optimizer)
            tensors["rng.data"] = gen.get_state()
            for r, t in enumerate(distributed.all_gather_bytes(torch.get_rng_state(), ctx)):
                tensors[f"rng.torch.{r}"] = t
            if device.type == "cuda":
                states = distributed.all_gather_bytes(torch.cuda.get_rng_state(device), ctx)
                for r, t in enumerate(states):
                    tensors[f"rng.cuda.{r}"] = t
            tensors["interval_loss"] = interval_loss.detach().cpu().reshape(())
            meta = {"step": step, "best_val_loss": best_val if math.isfinite(best_val)
                    else None, "elapsed": elapsed0 + (time.perf_counter() - t_start),
                    "interval_count": interval_count, "world_size": world,
                    "grad_accum": accum, "tokens_per_step": tokens_per_step,
                    "tokens_seen": step * tokens_per_step, "optimizer": opt_meta,
                    "data_position": {"generator": "rng.data",
                                      "windows_drawn": step * accum * B * world}}
            if ctx.is_main:
                save_checkpoint(latest, raw, data.tokenizer, extra_config=extra,
                                train_tensors=tensors, train_meta=meta)
            last_saved = step

        # -- loop -------------------------------------------------------------------------
        if ctx.is_main:
            log.info("training %s parameters on %s (%d process%s), %s tokens/step, "
                     "%d steps%s -> %s", f"{n_params:,}", device, world,
                     "es" if world > 1 else "", f"{tokens_per_step:,}", cfg.max_steps,
                     f" or {cfg.time_budget:g} s" if cfg.time_budget else "", out)
        t_start = time.perf_counter()
        t_mark, step_mark, start_step = t_start, step, step
        eval_time = eval_total = 0.0  # evaluation/saving seconds: this interval, before it
        gnorm = torch.zeros((), device=device)
        lr = cfg.lr
        stop_reason = "max_steps"
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        with stop.installed(), contextlib.closing(metrics), contextlib.closing(bar):
            while step < cfg.max_steps:
                lr = lr_at(step, lr=cfg.lr, warmup_steps=cfg.warmup_steps,
                           total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                step_loss = torch.zeros((), device=device)
                for micro in range(accum):
                    x, y = get_batch(data.train, B * world, C, gen, device)
                    x, y = ctx.shard(x), ctx.shard(y)  # (N·B, C) -> (B, C)
                    sync = (model_run.no_sync() if ctx.enabled and micro < accum - 1
                            else contextlib.nullcontext())
                    with sync:
                        with amp:
                            loss = lm_loss(model_run(x), y)
                        (loss / accum).backward()
                    step_loss += loss.detach()
                gnorm = torch.nn.utils.clip_grad_norm_(params, clip)
                pending_ok.append(torch.isfinite(step_loss) & torch.isfinite(gnorm))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                interval_loss += step_loss / accum
                interval_count += 1
                step += 1
                bar.step()
                if on_step is not None:
                    on_step(step)

                # -- control: stop flags (agreed across ranks at log steps) ----------------
                now = time.perf_counter()
                at_log = step % cfg.log_every == 0
                time_up = (cfg.time_budget is not None
                           and elapsed0 + now - t_start >= cfg.time_budget)
                flags = [float(stop.received is not None), float(time_up)]
                if ctx.enabled:
                    flags = (distributed.all_reduce_max(flags, ctx) if at_log
                             else [0.0, 0.0])
                interrupted, time_up = flags[0] > 0, flags[1] > 0
                if cfg.time_budget is not None and at_log:
                    spent = elapsed0 + now - t_start
                    per_step = (now - t_start - eval_total - eval_time) / (step - start_step)
                    if per_step > 0:
                        est = step + max(0.0, cfg.time_budget - spent) / per_step
                        total_steps = min(float(cfg.max_steps),
                                          distributed.broadcast_floats([est], ctx)[0])
                        bar.set_total(int(total_steps))

                record: dict[str, Any] = {}
                final = step >= cfg.max_steps or time_up or interrupted
                if at_log or (final and interval_count):
                    check_finite()
                    mean_loss = interval_loss.item() / max(1, interval_count)
                    dt = now - t_mark - eval_time
                    tok_s = (step - step_mark) * tokens_per_step / dt if dt > 0 else 0.0
                    record = {"step": step, "train_loss": mean_loss, "lr": lr,
                              "grad_norm": gnorm.item(), "tokens_per_s": tok_s}
                    eta = (total_steps - step) * dt / max(1, step - step_mark)
                    # a time budget's total is an estimate: never show step > total
                    shown = step if final else max(step, int(total_steps))
                    bar.report(step, shown, mean_loss, lr, tok_s, max(0.0, eta))
                    interval_loss.zero_()
                    interval_count = 0
                    t_mark, step_mark = now, step
                    eval_total, eval_time = eval_total + eval_time, 0.0
                if step % cfg.eval_every == 0 and not final:
                    t0 = time.perf_counter()
                    if ctx.is_main:
                        val, ppl = run_eval(cfg.eval_windows)
                        record.update(step=step, lr=lr, val_loss=val, val_ppl=ppl)
                        bar.message(f"step {step}: val loss {val:.4f} (ppl {ppl:.2f})")
                    eval_time += time.perf_counter() - t0
                if record:
                    record["elapsed"] = elapsed0 + time.perf_counter() - t_start
                    metrics.write(record)
                    if "val_loss" in record and ctx.is_main:
                        _redraw(out, metrics.records, cfg.plot_log_scale)
                if final:
                    stop_reason = ("interrupted" if interrupted else
                                   "time_budget" if time_up else "max_steps")
                    break
                if step % cfg.save_every == 0:
                    t0 = time.perf_counter()
                    save_latest()
                    eval_time += time.perf_counter() - t0

            train_time = time.perf_counter() - t_start
            pure_time = train_time - eval_total - eval_time
            bar.close()
            final_val = final_ppl = None
            if stop_reason != "interrupted":
                if ctx.is_main:
                    final_val, final_ppl = run_eval(None)
                    metrics.write({"step": step, "lr": lr, "val_loss": final_val,
                                   "val_ppl": final_ppl, "final": True,
                                   "elapsed": elapsed0 + time.perf_counter() - t_start})
                    _redraw(out, metrics.records, cfg.plot_log_scale)
            save_latest()
            distributed.barrier(ctx)
        trained = step - (saved_step if resuming else 0)
        if ctx.is_main and stop_reason == "interrupted":
            log.warning("interrupted at step %d; saved %s (continue with --resume)", step,
                        latest)
        return TrainResult(
            out_dir=out, steps=step, final_val_loss=final_val, final_val_perplexity=final_ppl,
            best_val_loss=best_val if math.isfinite(best_val) else None,
            tokens_per_s=trained * tokens_per_step / pure_time if pure_time > 0 else 0.0,
            elapsed=elapsed0 + train_time, stop_reason=stop_reason, rank=ctx.rank)
    finally:
        distributed.shutdown(ctx)


def _redraw(out: Path, records: list[dict[str, Any]], log_scale: bool) -> None:
    """Redraw OUT/loss.png; a missing matplotlib only costs the picture."""
    try:
        plot_losses([(out.resolve().name, records)], out / PLOT_FILE, log_scale=log_scale)
    except TinyLMError as exc:
        log.warning("loss.png not drawn: %s", exc)
