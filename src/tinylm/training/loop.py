"""The training loop: schedule, accumulation, clipping, evaluation, checkpoints, metrics.

``train(model_config, train_config, data_dir, out_dir)`` turns a prepared data folder
into a run folder::

    OUT/latest/       the newest checkpoint (model, config, tokenizer, training state)
    OUT/best/         the checkpoint with the lowest periodic validation estimate
    OUT/metrics.jsonl one JSON object per logged step (train loss, val estimate, lr, ...)
    OUT/loss.png      train loss, val estimates and the final val loss vs step
    OUT/run.toml      the effective configuration (reusable with --config)
    OUT/.lock         held (an OS lock) while a process trains into OUT

:func:`train` is a loop over named phases, each a function over the small typed parts
of :mod:`tinylm.training.state` it owns: restore (:func:`tinylm.training.runfolder.find_run`,
:func:`tinylm.training.setup.setup` -> ``Setup``/``Feed``,
:func:`tinylm.training.setup.restore` -> ``Counters``/``Best``), step (``_train_step``:
``Counters``, ``Health``), control (``_control``: ``Stop``, the schedule length in
``Clock``), log (``_log_phase``), evaluate (``_eval_phase``: ``Best``), save
(:func:`tinylm.training.saving.save_latest`), finish (``_finish``). The other parts of
the room: :mod:`~tinylm.training.optim` (AdamW groups, Muon, the lr schedule),
:mod:`~tinylm.training.runlog` (metrics.jsonl, progress, plots),
:mod:`~tinylm.training.batches` (the data and its batches),
:mod:`~tinylm.training.threads`, :mod:`~tinylm.training.distributed`.

Choices, and why:

* AdamW with decoupled weight decay on weight *matrices* only, or Muon on the blocks'
  matrices (:mod:`tinylm.training.optim`).
* Learning rate: linear warm-up, then a cosine to ``lr * min_lr_ratio``
  (:func:`~tinylm.training.optim.lr_at`). With ``time_budget`` the cosine's length is the
  number of steps the budget allows at the measured speed, so a run on a slower machine
  still ends at the floor.
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
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinylm import acceleration
from tinylm.core.config import ModelConfig, TrainConfig, resolve_device
from tinylm.core.errors import ConfigError
from tinylm.core.model import lm_loss
from tinylm.io.checkpoint_files import RUN_BEST, RUN_LATEST, save_checkpoint
from tinylm.io.files import FolderLock
from tinylm.training import distributed
from tinylm.training.batches import TrainData, data_name, draw_batch, load_data
from tinylm.training.optim import lr_at, set_lr
from tinylm.training.runfolder import (
    Found,
    find_run,
    is_finished,
    layer_configs,
    prepare_out,
    resume_mode,
)
from tinylm.training.saving import peak_rss_now, save_latest
from tinylm.training.setup import announce, open_logs, restore, setup
from tinylm.training.state import Clock, Health, Run, Setup, Stop
from tinylm.training.threads import command_threads, using_threads
from tinylm.use.evaluation import (
    EvalResult,
    check_same_tokenizer,
    estimate_loss,
    evaluate,
    perplexity,
    sample_windows,
)

log = logging.getLogger(__name__)


class NonFiniteLossError(ConfigError):
    """The loss or gradient became NaN/inf; the last good checkpoint is kept."""


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



# --- phase: step -----------------------------------------------------------------------------


def _train_step(run: Run) -> None:
    """One optimizer step: accumulate ``accum`` micro-batches, clip, update."""
    built, feed, counters, health = run.setup, run.feed, run.counters, run.health
    cfg, ctx = built.cfg, built.ctx
    health.lr = lr_at(counters.step, lr=cfg.lr, warmup_steps=run.clock.warmup_steps,
                      total_steps=run.clock.total_steps, min_lr_ratio=cfg.min_lr_ratio)
    set_lr(built.optimizer, health.lr)
    step_loss = torch.zeros((), device=built.device)
    for micro in range(feed.accum):
        x, y = draw_batch(feed.data.train, feed.train_mask, feed.B * ctx.world_size, feed.C,
                          feed.gen, ctx, built.device)
        with distributed.gradient_sync(built.model_run, ctx, micro == feed.accum - 1):
            with built.amp:
                loss = lm_loss(built.model_run(x), y)
            (loss / feed.accum).backward()
        step_loss += loss.detach()
    clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
    health.gnorm = distributed.full_tensor(torch.nn.utils.clip_grad_norm_(built.params, clip))
    health.pending_ok.append(torch.isfinite(step_loss) & torch.isfinite(health.gnorm))
    built.optimizer.step()
    built.optimizer.zero_grad(set_to_none=True)
    counters.interval_loss += step_loss / feed.accum
    counters.interval_count += 1
    counters.step += 1
    run.logs.bar.step()


def _check_finite(run: Run) -> None:
    """Read the pending finiteness flags (one host sync); stop on the first bad step."""
    health = run.health
    if not health.pending_ok:
        return
    ok = torch.stack(health.pending_ok).cpu()
    if not bool(ok.all()):
        bad = health.pending_from + int((~ok).nonzero()[0, 0])
        cfg = run.setup.cfg
        if health.last_saved is not None:
            kept = (f"the last good checkpoint {run.setup.latest} (step {health.last_saved}) "
                    f"is kept")
            then = "then continue with --resume"
        else:
            kept, then = "no checkpoint had been written yet", "then start the run again"
        clip = "" if cfg.grad_clip > 0 else " or use --grad-clip 1"
        raise NonFiniteLossError(
            f"loss or gradient became non-finite (nan/inf) at step {bad}; training stopped "
            f"and {kept}; lower --lr (now {cfg.lr:g}) or raise --warmup-steps{clip}, {then}")
    health.pending_ok, health.pending_from = [], run.counters.step + 1


# --- phase: control --------------------------------------------------------------------------


def _control(run: Run, now: float) -> bool:
    """Stop flags (agreed across ranks at log steps) and the time budget's schedule
    length; sets ``run.stop`` and ``run.clock.total_steps``. Returns whether this is a
    log step."""
    cfg, ctx, clock, step = run.setup.cfg, run.setup.ctx, run.clock, run.counters.step
    at_log = step % cfg.log_every == 0
    spent = run.counters.elapsed0 + now - clock.t_start
    time_up = cfg.time_budget is not None and spent >= cfg.time_budget
    flags = [float(run.logs.signal.received is not None), float(time_up)]
    if ctx.enabled:
        flags = distributed.all_reduce_max(flags, ctx) if at_log else [0.0, 0.0]
    interrupted, time_up = flags[0] > 0, flags[1] > 0
    # the budget's steps: estimated at log steps and, for a warm-up that must fit a short
    # budget, after each of the first steps (the same steps on every rank)
    if cfg.time_budget is not None and (at_log or step - clock.start_step <= _EARLY_STEPS):
        busy = now - clock.t_start - clock.eval_total - clock.eval_time
        per_step = busy / (step - clock.start_step)
        if per_step > 0:
            est = step + max(0.0, cfg.time_budget - spent) / per_step
            clock.total_steps = min(float(cfg.max_steps),
                                    distributed.broadcast_floats([est], ctx)[0])
            run.logs.bar.set_total(int(clock.total_steps))
            _fit_warmup(run)
    run.stop.final = step >= cfg.max_steps or time_up or interrupted
    if run.stop.final:
        run.stop.reason = ("interrupted" if interrupted else
                           "time_budget" if time_up else "max_steps")
    return at_log


#: Steps after the start (or a resume) after which a time budget's length is estimated
#: even between log steps, so a warm-up longer than the budget is caught early.
_EARLY_STEPS = 3


def fitted_warmup(warmup_steps: int, max_steps: int, total_steps: float) -> int:
    """The warm-up for a run cut to ``total_steps``: the configured schedule's share of
    warm-up (``warmup_steps / max_steps``, at most half) of the steps that fit, >= 1."""
    share = min(warmup_steps / max_steps, 0.5)
    return max(1, min(round(total_steps * share), int(total_steps) // 2))


def _fit_warmup(run: Run) -> None:
    """Once, when the time budget ends before the configured warm-up would: scale the
    warm-up to the steps that fit (the cosine then decays over the rest), and say so."""
    cfg, clock, step = run.setup.cfg, run.clock, run.counters.step
    binds = clock.total_steps < cfg.max_steps  # the budget, not --max-steps, ends the run
    if clock.warmup_fitted or not binds or clock.total_steps > cfg.warmup_steps or \
            step >= cfg.warmup_steps:
        return
    clock.warmup_fitted = True
    clock.warmup_steps = fitted_warmup(cfg.warmup_steps, cfg.max_steps, clock.total_steps)
    n = clock.warmup_steps
    run.logs.bar.message(
        f"the time budget ({cfg.time_budget:g} s) fits about {int(clock.total_steps)} steps, "
        f"fewer than the warm-up ({cfg.warmup_steps} steps): warming up over {n} "
        f"step{'s' if n != 1 else ''} instead, so the learning rate reaches its peak "
        f"{cfg.lr:g}, then decaying over the rest (--warmup-steps sets another)",
        logging.WARNING)


# --- phase: log ------------------------------------------------------------------------------


def _log_phase(run: Run, now: float, at_log: bool) -> dict[str, Any]:
    """The train record of a log step (mean loss over ranks and steps since the last);
    starts the next interval (counters and clock marks)."""
    counters, clock, bar = run.counters, run.clock, run.logs.bar
    if not (at_log or (run.stop.final and counters.interval_count)):
        return {}
    _check_finite(run)
    total = distributed.all_reduce_mean(counters.interval_loss, run.setup.ctx)
    mean_loss = total.item() / max(1, counters.interval_count)
    dt = now - clock.t_mark - clock.eval_time
    steps = counters.step - clock.step_mark
    tok_s = steps * run.feed.tokens_per_step / dt if dt > 0 else 0.0
    lr = run.health.lr
    record = {"step": counters.step, "train_loss": mean_loss, "lr": lr,
              "grad_norm": run.health.gnorm.item(), "tokens_per_s": tok_s}
    eta = (clock.total_steps - counters.step) * dt / max(1, steps)
    # a time budget's total is an estimate: never show step > total
    shown = counters.step if run.stop.final else max(counters.step, int(clock.total_steps))
    bar.report(counters.step, shown, mean_loss, lr, tok_s, max(0.0, eta))
    run.logs.throughput.watch(tok_s, bar)
    counters.interval_loss.zero_()
    counters.interval_count = 0
    clock.t_mark, clock.step_mark = now, counters.step
    clock.eval_total, clock.eval_time = clock.eval_total + clock.eval_time, 0.0
    return record


def _write_record(run: Run, record: dict[str, Any]) -> None:
    if not record:
        return
    record["elapsed"] = run.counters.elapsed0 + time.perf_counter() - run.clock.t_start
    run.logs.metrics.write(record)
    if "val_loss_estimate" in record and run.setup.ctx.is_main:
        _redraw(run)


def _redraw(run: Run) -> None:
    """Redraw OUT/loss.png (:meth:`tinylm.training.runlog.MetricsLog.redraw`)."""
    run.logs.metrics.redraw(run.setup.out, run.setup.cfg.plot_log_scale)


# --- phase: evaluate -------------------------------------------------------------------------


def _eval_model(run: Run) -> nn.Module | None:
    """The module this rank evaluates (None: this rank does not): rank 0's model, or
    under fsdp the sharded model on every rank (a collective forward; each rank gets the
    same result)."""
    return run.setup.raw if run.setup.ctx.is_main or run.setup.fsdp else None


@contextlib.contextmanager
def _fast_paths(built: Setup) -> Iterator[None]:
    """Evaluation under fsdp: every fast path off, the root's parameters gathered."""
    if not built.fsdp:
        yield
        return
    with acceleration.disabled(), distributed.root_unsharded(built.raw):
        yield


def _estimate(run: Run, model: nn.Module) -> tuple[float, float]:
    """The periodic validation estimate: the fixed random sample of windows."""
    _check_finite(run)
    built, feed = run.setup, run.feed
    with _fast_paths(built):
        r = estimate_loss(model, feed.data.val, feed.eval_starts, context_length=feed.C,
                          batch_size=2 * feed.B, loss_mask=feed.val_mask)
    built.raw.train()
    if built.fsdp:  # every rank computed it; rank 0's value decides best/ everywhere
        loss = distributed.broadcast_floats([r.loss], built.ctx)[0]
        return loss, perplexity(loss)
    return r.loss, r.perplexity


def _keep_if_best(run: Run, estimate: float, model: nn.Module) -> None:
    """best/ follows the lowest estimate (always the same sample: like for like)."""
    if estimate < run.best.value:
        run.best.value = estimate
        built, feed = run.setup, run.feed
        # under fsdp every rank gathers (a collective), rank 0 gets the whole weights
        state = distributed.full_model_state(built.raw, built.ctx) if built.fsdp else None
        if built.ctx.is_main:
            save_checkpoint(built.out / RUN_BEST, model, feed.data.tokenizer, state=state,
                            extra_config={**built.extra, "best": {
                                "step": run.counters.step, "val_loss_estimate": estimate,
                                "eval_windows": len(feed.eval_starts)}})


def _eval_phase(run: Run, record: dict[str, Any]) -> None:
    step, windows = run.counters.step, len(run.feed.eval_starts)
    if step % run.setup.cfg.eval_every or run.stop.final:
        return
    t0 = time.perf_counter()
    model = _eval_model(run)
    if model is not None:
        val, ppl = _estimate(run, model)
        _keep_if_best(run, val, model)
        record.update(step=step, lr=run.health.lr, val_loss_estimate=val,
                      val_ppl_estimate=ppl, val_windows=windows)
        run.logs.bar.message(f"step {step}: val loss {val:.4f} (ppl {ppl:.2f}, estimate on "
                             f"{windows} windows)")
    run.clock.eval_time += time.perf_counter() - t0


def _final_eval(run: Run, model: nn.Module) -> EvalResult:
    """The exact loss over the whole validation split (masked: over every window)."""
    feed = run.feed
    if feed.val_mask is None:
        return evaluate(model, feed.data.val, context_length=feed.C, batch_size=2 * feed.B)
    every = sample_windows(len(feed.data.val), feed.C, None, run.setup.cfg.seed)
    return estimate_loss(model, feed.data.val, every, context_length=feed.C,
                         batch_size=2 * feed.B, loss_mask=feed.val_mask)


# --- phases: save, finish --------------------------------------------------------------------


def _save(run: Run, **kwargs: Any) -> None:
    """The pending finiteness flags, then OUT/latest (:func:`~tinylm.training.saving.
    save_latest`): a non-finite step is never saved."""
    _check_finite(run)
    save_latest(run, **kwargs)


def _finish(run: Run, peak_rss: float) -> tuple[float, EvalResult | None]:
    """After the loop: like-for-like best/, the exact whole-split loss, the last save.
    Returns the training seconds without evaluation and saving, and the final result
    (None when interrupted, or on a rank that does not evaluate)."""
    clock = run.clock
    train_time = time.perf_counter() - clock.t_start
    pure_time = train_time - clock.eval_total - clock.eval_time
    run.logs.bar.close()
    model = _eval_model(run) if run.stop.reason != "interrupted" else None
    final = None
    if model is not None:
        estimate, _ = _estimate(run, model)
        _keep_if_best(run, estimate, model)
        with _fast_paths(run.setup):
            final = _final_eval(run, model)
        run.setup.raw.train()
        run.logs.metrics.write({"step": run.counters.step, "lr": run.health.lr,
                                "val_loss": final.loss, "val_ppl": final.perplexity,
                                "val_loss_estimate": estimate, "final": True,
                                "elapsed": run.counters.elapsed0 + time.perf_counter()
                                - clock.t_start})
        if run.setup.ctx.is_main:
            _redraw(run)
    _save(run, final_val=final.loss if final is not None else None, peak_rss=peak_rss)
    distributed.barrier(run.setup.ctx)
    return pure_time, final


def _loop(run: Run, on_step: Callable[[int], None] | None) -> TrainResult:
    """Step, evaluate, log and save until the run's end; then finish."""
    cfg, clock, counters, logs = run.setup.cfg, run.clock, run.counters, run.logs
    with logs.signal.installed(), contextlib.closing(logs.metrics), \
            contextlib.closing(logs.bar):
        announce(run.setup, run.feed, counters.resumed_from)
        logs.bar.open(counters.step, cfg.max_steps)
        clock.t_start = clock.t_mark = time.perf_counter()
        clock.step_mark = clock.start_step = counters.step
        while True:
            _train_step(run)
            if on_step is not None:
                on_step(counters.step)
            now = time.perf_counter()
            at_log = _control(run, now)
            record = _log_phase(run, now, at_log)
            _eval_phase(run, record)
            _write_record(run, record)
            if run.stop.final:
                break
            if counters.step % cfg.save_every == 0:
                t0 = time.perf_counter()
                _save(run)
                clock.eval_time += time.perf_counter() - t0
        # the peak memory of the training steps: before the final evaluation and best/
        pure_time, final = _finish(run, peak_rss_now())
    return _result(run, pure_time, final)


def _result(run: Run, pure_time: float, final: EvalResult | None) -> TrainResult:
    counters, feed = run.counters, run.feed
    trained = counters.step - (counters.resumed_from or 0)
    return TrainResult(
        out_dir=run.setup.out, steps=counters.step,
        final_val_loss=final.loss if final is not None else None,
        final_val_perplexity=final.perplexity if final is not None else None,
        best_val_loss=run.best.loss,
        tokens_per_s=trained * feed.tokens_per_step / pure_time if pure_time > 0 else 0.0,
        elapsed=counters.elapsed0 + time.perf_counter() - run.clock.t_start,
        stop_reason=run.stop.reason, rank=run.setup.ctx.rank,
        resumed_from=counters.resumed_from)


def _finished_result(out: Path, found: Found, ctx: distributed.DistContext) -> TrainResult:
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


def _start(model_config: ModelConfig, cfg: TrainConfig, data: TrainData, out: Path,
           ctx: distributed.DistContext, found: Found, model: nn.Module | None,
           extra: dict[str, Any], progress: bool | None, stack: contextlib.ExitStack) -> Run:
    """The setup and restore phases: every part of the run, ready for the first step."""
    built, feed = setup(model_config, cfg, data, out, ctx, found, model, extra, stack)
    counters, best = restore(built, feed, found)
    health = Health(lr=cfg.lr, gnorm=torch.zeros((), device=built.device),
                    pending_from=counters.step + 1, last_saved=counters.resumed_from)
    logs = open_logs(built, counters.step if found.resuming else None, progress)
    return Run(setup=built, feed=feed, counters=counters, best=best, health=health,
               clock=Clock(total_steps=float(cfg.max_steps), warmup_steps=cfg.warmup_steps),
               stop=Stop(), logs=logs)


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
    data = load_data(data_dir)
    check_same_tokenizer(model_tokenizer, data.tokenizer, data_name(data),
                         fix="prepare the data with the model's tokenizer (tinylm prepare "
                             "--tokenizer MODEL_DIR/tokenizer.json)")
    ctx = distributed.init_from_env(resolve_device(cfg.device).type)
    lock = None
    try:
        if ctx.is_main:
            prepare_out(out)
            lock = FolderLock(out).acquire()
        # the stack undoes the fast paths applied to the model (setup): the caller's
        # model gets its own classes back, whether train returns or raises
        with using_threads(cfg.threads), contextlib.ExitStack() as stack:
            found = find_run(out, resume_mode(resume), ctx, model_config)
            if found.resuming and is_finished(found, cfg):
                return _finished_result(out, found, ctx)
            extra = {**(extra_config or {}), "train": cfg.to_dict()}
            run = _start(model_config, cfg, data, out, ctx, found, model, extra, progress,
                         stack)
            return _loop(run, on_step)
    except RuntimeError as exc:  # a collective failed because a rank died: one line
        distributed.reraise(exc, ctx)
    finally:
        if lock is not None:
            lock.release()
        distributed.shutdown(ctx)


def train_run(data_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
              config_file: str | os.PathLike | None = None,
              overrides: dict[str, Any] | None = None, resume: bool | str | None = None,
              progress: bool | None = None, arch: str | None = None) -> TrainResult:
    """``tinylm train``: :func:`~tinylm.training.runfolder.layer_configs`, then
    :func:`train`, with ``threads`` defaulting to
    :func:`tinylm.core.config.default_threads` when no layer sets it."""
    model_config, train_config = layer_configs(out_dir, config_file=config_file,
                                               overrides=overrides, resume=resume, arch=arch)
    with command_threads(train_config.threads):
        return train(model_config, train_config, data_dir, out_dir, resume=resume,
                     progress=progress)

