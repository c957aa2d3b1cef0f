"""The state of one training run, in small typed parts, each written by the phase of
:mod:`tinylm.training.loop` that owns it.

:class:`Setup` and :class:`Feed` are built once by the setup phase
(:func:`tinylm.training.setup.setup`); :class:`Counters` and :class:`Best` are what the
restore phase puts back from latest/ (or starts afresh); :class:`Health`, :class:`Clock`
and :class:`Stop` belong to the step, timing and control phases; :class:`Logs` is opened
once (:func:`tinylm.training.setup.open_logs`). :class:`Run` only bundles them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from tinylm.core.config import TrainConfig
from tinylm.io.checkpoint_files import RUN_LATEST
from tinylm.training.batches import TrainData
from tinylm.training.distributed import DistContext
from tinylm.training.runlog import MetricsLog, Progress, StopSignal, Throughput


@dataclass(frozen=True)
class Setup:
    """What the run trains and where: the model (``raw``, unwrapped; ``model_run``, what
    the steps call: wrapped for the ranks, perhaps compiled), its optimizer and the
    trainable ``params``, the process context and device, and the run folder."""

    cfg: TrainConfig
    ctx: DistContext
    device: torch.device
    out: Path
    raw: nn.Module
    model_run: nn.Module
    optimizer: torch.optim.Optimizer
    params: list[Tensor]
    amp: Any
    extra: dict[str, Any]  # config.json entries of every checkpoint of the run
    n_params: int
    n_trainable: int

    @property
    def latest(self) -> Path:
        return self.out / RUN_LATEST

    @property
    def strategy(self) -> str:
        """How ranks share the work (single process: the checkpoint layout only)."""
        return self.cfg.strategy

    @property
    def sharded(self) -> bool:
        """latest/ is a sharded checkpoint (zero1/fsdp)."""
        return self.cfg.strategy in ("zero1", "fsdp")

    @property
    def fsdp(self) -> bool:
        """Parameters sharded across ranks: evaluation is a collective of every rank."""
        return self.ctx.enabled and self.cfg.strategy == "fsdp"


@dataclass(frozen=True)
class Feed:
    """Where the batches come from: ``B`` windows of ``C`` tokens per rank and
    micro-batch, ``accum`` micro-batches per step, drawn with ``gen`` (which advances and
    is saved in latest/); ``eval_starts`` is the fixed sample of periodic evaluations."""

    data: TrainData
    gen: torch.Generator
    B: int
    C: int
    accum: int
    tokens_per_step: int
    eval_starts: np.ndarray
    train_mask: Any | None
    val_mask: Any | None

    def eval_sample(self, seed: int) -> dict[str, Any]:
        """What identifies the periodic evaluation sample (saved, compared on resume)."""
        return {"seed": seed, "windows": len(self.eval_starts), "context_length": self.C}


@dataclass
class Counters:
    """The training progress saved in latest/: restored (or zero) by the restore phase,
    advanced by the step phase; the log phase starts each interval afresh."""

    step: int
    interval_loss: Tensor  # the sum of step losses since the last log step (on device)
    interval_count: int = 0
    elapsed0: float = 0.0  # seconds of the earlier calls this run resumes
    resumed_from: int | None = None


@dataclass
class Health:
    """The step phase's learning rate, gradient norm and finiteness flags (kept on the
    device until a log, eval or save point reads them); ``last_saved`` is the step of
    the newest latest/, set by the save phase."""

    lr: float
    gnorm: Tensor
    pending_from: int = 1
    pending_ok: list[Tensor] = field(default_factory=list)
    last_saved: int | None = None


@dataclass
class Clock:
    """The run's timers: started by the loop; ``total_steps`` (the schedule's length,
    shortened to what a time budget allows) and ``warmup_steps`` (the warm-up, scaled
    down once when the budget ends before the configured one would) by the control
    phase; the marks by the log phase; ``eval_time`` (evaluation and saving since the
    last log step) by the evaluate and save phases."""

    total_steps: float
    warmup_steps: int = 0
    warmup_fitted: bool = False
    t_start: float = 0.0
    t_mark: float = 0.0
    start_step: int = 0
    step_mark: int = 0
    eval_time: float = 0.0
    eval_total: float = 0.0


@dataclass
class Stop:
    """The control phase's decision: whether this step is the last, and why."""

    final: bool = False
    reason: str = "max_steps"


@dataclass
class Best:
    """The lowest periodic validation estimate so far (the one best/ holds)."""

    value: float = math.inf

    @property
    def loss(self) -> float | None:
        return self.value if math.isfinite(self.value) else None


@dataclass(frozen=True)
class Logs:
    """What the run tells: metrics.jsonl, the progress display, the throughput watch,
    and the signal handler that asks for a stop."""

    metrics: MetricsLog
    bar: Progress
    throughput: Throughput
    signal: StopSignal


@dataclass(frozen=True)
class Run:
    """The parts of one run, for the phases of :func:`tinylm.training.loop.train`."""

    setup: Setup
    feed: Feed
    counters: Counters
    best: Best
    health: Health
    clock: Clock
    stop: Stop
    logs: Logs
