"""The setup and restore phases of :func:`tinylm.training.train`: build the model, the
optimizer and the batches (in the order that keeps exact resume exact), put a resumed
run's saved state back, and open the run's logs.

The native fast paths (tinylm.native) are applied here as a context that the caller's
:class:`contextlib.ExitStack` undoes, so a model handed to ``train`` gets its own
classes back when the call ends (as :func:`tinylm.use.evaluation.evaluate` does). A CPU
run also keeps the memory its steps free in the process
(:func:`tinylm.training.heap.keep_freed_memory`), which is not undone.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from tinylm import acceleration
from tinylm.core.config import ModelConfig, TrainConfig, resolve_device, to_toml
from tinylm.core.errors import ConfigError
from tinylm.core.model import GPT, lm_loss
from tinylm.data import get_batch
from tinylm.io.checkpoint import (
    build_model,
    is_sharded,
    load_model,
    load_optimizer_state,
    load_tokenizer_of,
    load_train_state,
    read_config,
)
from tinylm.io.checkpoint_files import RUN_LATEST, SHARDS_DIR, unwrap_model
from tinylm.io.files import atomic_write
from tinylm.training import distributed, heap
from tinylm.training.batches import (
    TrainData,
    check_lengths,
    check_token_ids,
    data_name,
    mask_of,
    window_length,
)
from tinylm.training.optim import build_optimizer, optimizer_recipe
from tinylm.training.runfolder import RUN_CONFIG_FILE, Found, preflight
from tinylm.training.runlog import MetricsLog, Progress, StopSignal, Throughput
from tinylm.training.state import Best, Counters, Feed, Logs, Setup
from tinylm.use.evaluation import check_same_tokenizer, sample_windows

log = logging.getLogger(__name__)


def build_raw_model(model_config: ModelConfig, cfg: TrainConfig, data: TrainData,
                    found: Found, model: nn.Module | None, out: Path) -> nn.Module:
    """The module to train: the saved one (resume), the given one, or a fresh GPT. (A
    resumed run's config was checked against the saved one by
    :func:`tinylm.training.runfolder.find_run`.)"""
    latest = out / RUN_LATEST
    if found.resuming:
        check_same_tokenizer(load_tokenizer_of(latest), data.tokenizer, data_name(data),
                             fix="resume with the data this run was trained on, or start "
                                 "a new --out")
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
    return GPT(model_config.replace(vocab_size=data.tokenizer.vocab_size))


def setup(model_config: ModelConfig, cfg: TrainConfig, data: TrainData, out: Path,
          ctx: distributed.DistContext, found: Found, model: nn.Module | None,
          extra: dict[str, Any], stack: contextlib.ExitStack) -> tuple[Setup, Feed]:
    """Build everything a run needs, in the order that keeps exact resume exact; the
    fast paths applied to the model are undone when ``stack`` closes."""
    device = distributed.device_for(ctx, resolve_device(cfg.device))
    if device.type == "cpu":  # the steps' activations reuse the pages freed by the last
        heap.keep_freed_memory()
    raw = build_raw_model(model_config, cfg, data, found, model, out)
    C = window_length(data, raw.config.context_length)
    check_lengths(data, C)
    check_token_ids(data, raw.config.vocab_size)
    n_params = sum(p.numel() for p in raw.parameters())
    if ctx.is_main:
        preflight(out, n_params)
    distributed.barrier(ctx)
    raw.to(device)
    B, world = cfg.batch_size, ctx.world_size
    accum = grad_accum(cfg, found, B, C, world)
    amp = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
           else contextlib.nullcontext())
    model_run, optimizer = apply_strategy(raw, cfg, ctx, device, data, amp, stack)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise ConfigError("the model has no parameter with requires_grad=True; nothing to "
                          "train")
    built = Setup(cfg=cfg, ctx=ctx, device=device, out=out, raw=raw, model_run=model_run,
                  optimizer=optimizer, params=params, amp=amp, extra=extra,
                  n_params=n_params, n_trainable=sum(p.numel() for p in params))
    feed = Feed(data=data, gen=torch.Generator().manual_seed(cfg.seed), B=B, C=C,
                accum=accum, tokens_per_step=B * accum * world * C,
                eval_starts=sample_windows(len(data.val), C, cfg.eval_windows, cfg.seed),
                train_mask=mask_of(data, "train"), val_mask=mask_of(data, "val"))
    return built, feed


def grad_accum(cfg: TrainConfig, found: Found, B: int, C: int, world: int) -> int:
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


def apply_strategy(raw: nn.Module, cfg: TrainConfig, ctx: distributed.DistContext,
                   device: torch.device, data: TrainData, amp: Any, stack: contextlib.ExitStack
                   ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """(the module to run, the optimizer) under ``cfg.strategy``.

    The native fast paths (tinylm.native) step aside under fsdp: their eligibility
    would take the FSDP model for a plain GPT (FSDP2's class is a subclass of it) and
    read the DTensor shards as whole weights. So a sharded model is not accelerated,
    and its evaluations run with every fast path off (``_fast_paths`` in
    :mod:`tinylm.training.loop`)."""
    if not (ctx.enabled and cfg.strategy == "fsdp"):
        # the fast paths, decided once (tinylm.native); undone when the stack closes
        plan = stack.enter_context(acceleration.accelerate(raw, device))
    else:
        plan = acceleration.ReferencePlan(raw)
    model_run = distributed.wrap_model(raw, ctx, device, cfg.strategy)
    if cfg.compile:
        sample = get_batch(data.train, cfg.batch_size,
                           window_length(data, raw.config.context_length),
                           torch.Generator().manual_seed(0), device)
        model_run = maybe_compile(model_run, plan, sample, amp)
    if ctx.enabled and cfg.strategy == "zero1":
        optimizer = distributed.zero_optimizer(*optimizer_recipe(raw, cfg, device), ctx)
    else:
        optimizer = build_optimizer(raw, cfg, device)
    return model_run, optimizer


def maybe_compile(model: nn.Module, plan: Any, sample: tuple[Tensor, Tensor], amp: Any
                  ) -> nn.Module:
    """``plan.compile(model)`` (the plan of the fast paths decides what the graph holds:
    tinylm's custom ops on CPU, the reference model elsewhere), proven on one
    forward/backward of ``sample``, whose time (the warm-up: tracing, code generation,
    or loading them from the cache) is logged; on failure warn and return the eager
    model (e.g. no C++ compiler, unsupported platform)."""
    start = time.perf_counter()
    try:
        compiled = plan.compile(model)
        x, y = sample
        with amp:
            loss = lm_loss(compiled(x), y)
        loss.backward()
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
    log.info("--compile: %s in the graph; warm-up (the first compiled step: tracing and "
             "code generation, or the cache) %.1f s", plan.compiled_path,
             time.perf_counter() - start)
    return compiled


def restore(built: Setup, feed: Feed, found: Found) -> tuple[Counters, Best]:
    """Put the saved training state (weights, optimizer, RNGs, counters) back, or seed a
    new run; returns the run's counters and best estimate."""
    ctx, device, cfg = built.ctx, built.device, built.cfg
    if not found.resuming:
        torch.manual_seed(cfg.seed + 1 + ctx.rank)  # dropout masks differ per rank
        return Counters(step=0, interval_loss=torch.zeros((), device=device)), Best()
    tensors, meta = load_train_state(built.latest)
    _restore_weights_and_optimizer(built, tensors, meta)
    feed.gen.set_state(tensors["rng.data"])
    key = f"rng.torch.{ctx.rank}"
    if key in tensors and meta.get("world_size") == ctx.world_size:
        torch.set_rng_state(tensors[key])
        if device.type == "cuda" and f"rng.cuda.{ctx.rank}" in tensors:
            torch.cuda.set_rng_state(tensors[f"rng.cuda.{ctx.rank}"], device)
    else:
        log.warning("resuming with %d processes instead of %d: dropout masks are "
                    "reseeded, so the run is not bitwise identical", ctx.world_size,
                    meta.get("world_size"))
        torch.manual_seed(cfg.seed + 1 + ctx.rank + meta["step"])
    step = int(meta["step"])
    best = Best()
    sample = meta.get("eval_sample")
    if sample is None or sample == feed.eval_sample(cfg.seed):
        best.value = float(meta.get("best_val_loss") or math.inf)
    else:
        log.warning("the periodic evaluation sample changed (eval_windows or seed); best/ "
                    "is chosen afresh from now on")
    counters = Counters(step=step, interval_loss=tensors["interval_loss"].to(device),
                        interval_count=int(meta.get("interval_count", 0)),
                        elapsed0=float(meta.get("elapsed", 0.0)), resumed_from=step)
    return counters, best


def _restore_weights_and_optimizer(built: Setup, tensors: dict[str, Tensor],
                                   meta: dict[str, Any]) -> None:
    """A sharded latest/ loads into any strategy and number of ranks (resharded as it is
    read); an ordinary one into ddp or one process (its optimizer state is whole)."""
    if is_sharded(built.latest):
        distributed.load_shards(built.raw, built.optimizer, built.latest / SHARDS_DIR,
                                built.ctx)
        return
    if built.sharded and built.ctx.enabled:
        saved = (meta.get("strategy") or "ddp")
        raise ConfigError(f"--resume: {built.latest} is an unsharded checkpoint (strategy "
                          f"{saved}); resume it with --strategy {saved}, or with one process "
                          f"(which then writes a sharded checkpoint)")
    load_optimizer_state(built.optimizer, tensors, meta["optimizer"])


def open_logs(built: Setup, resume_step: int | None, progress: bool | None) -> Logs:
    """run.toml (the effective configuration) and metrics.jsonl (kept up to
    ``resume_step`` when resuming), on rank 0; the progress display."""
    if built.ctx.is_main:
        atomic_write(built.out / RUN_CONFIG_FILE, to_toml({
            "model": {k: v for k, v in built.raw.config.to_dict().items()
                      if k != "vocab_size"},
            "train": built.cfg.to_dict()}))
    return Logs(metrics=MetricsLog(built.out, built.ctx.is_main, resume_step),
                bar=Progress(built.ctx.is_main, progress), throughput=Throughput(),
                signal=StopSignal())


def announce(built: Setup, feed: Feed, resumed_from: int | None) -> None:
    """The header (before the bar starts, so it never shares the bar's line)."""
    cfg, ctx = built.cfg, built.ctx
    if not ctx.is_main:
        return
    if resumed_from is not None:
        log.info("resuming from step %d (%s)", resumed_from, built.latest)
    frozen = built.n_params - built.n_trainable
    log.info("training %s parameters%s on %s (%d process%s), %s tokens/step, %d steps%s -> %s",
             f"{built.n_trainable:,}", f" ({frozen:,} frozen)" if frozen else "",
             built.device, ctx.world_size, "es" if ctx.world_size > 1 else "",
             f"{feed.tokens_per_step:,}", cfg.max_steps,
             f" or {cfg.time_budget:g} s" if cfg.time_budget else "", built.out)
    if cfg.warmup_steps >= cfg.max_steps and cfg.time_budget is None:
        log.warning("the warm-up (warmup_steps %d) is as long as the run (max_steps %d): the "
                    "learning rate only ramps up and never reaches its cosine decay; lower "
                    "--warmup-steps", cfg.warmup_steps, cfg.max_steps)
