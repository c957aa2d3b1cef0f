"""The save phase of :func:`tinylm.training.train`: OUT/latest with everything an exact
resume needs (weights, optimizer moments, every rank's RNG, the data generator, the
partial loss accumulators), written whole or, under zero1/fsdp, one shard per rank."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from tinylm.io.checkpoint import optimizer_state
from tinylm.io.checkpoint_files import SHARDS_DIR, new_temporary, save_checkpoint
from tinylm.training import distributed
from tinylm.training.state import Run


def save_latest(run: Run, *, final_val: float | None = None,
                peak_rss: float | None = None) -> None:
    """Write OUT/latest: weights, optimizer, every rank's RNG, counters (rank 0 writes;
    under zero1/fsdp every rank writes its shard of the weights and optimizer state).
    ``final_val`` is the whole-split loss of a finished run; ``peak_rss`` the peak
    memory of the training steps (None: measured now). The caller has read the pending
    finiteness flags (a non-finite step is never saved)."""
    built, feed, counters, ctx = run.setup, run.feed, run.counters, run.setup.ctx
    tensors, opt_meta = ({}, {"sharded": True}) if built.sharded else \
        optimizer_state(built.optimizer)
    tensors["rng.data"] = feed.gen.get_state()
    for r, t in enumerate(distributed.all_gather_bytes(torch.get_rng_state(), ctx)):
        tensors[f"rng.torch.{r}"] = t
    if built.device.type == "cuda":
        states = distributed.all_gather_bytes(torch.cuda.get_rng_state(built.device), ctx)
        for r, t in enumerate(states):
            tensors[f"rng.cuda.{r}"] = t
    tensors["interval_loss"] = counters.interval_loss.detach().cpu().reshape(())
    step = counters.step
    meta = {"step": step, "best_val_loss": run.best.loss,
            "elapsed": counters.elapsed0 + (time.perf_counter() - run.clock.t_start),
            "interval_count": counters.interval_count, "world_size": ctx.world_size,
            "strategy": built.strategy, "grad_accum": feed.accum,
            "tokens_per_step": feed.tokens_per_step,
            "tokens_seen": step * feed.tokens_per_step, "optimizer": opt_meta,
            "eval_sample": feed.eval_sample(built.cfg.seed),
            "stop_reason": run.stop.reason if run.stop.final else None,
            "final_val_loss": final_val, "memory": _memory(run, peak_rss),
            "data_position": {"generator": "rng.data",
                              "windows_drawn": step * feed.accum * feed.B * ctx.world_size}}
    if built.sharded:
        _save_sharded(run, tensors, meta)
    elif ctx.is_main:
        save_checkpoint(built.latest, built.raw, feed.data.tokenizer, extra_config=built.extra,
                        train_tensors=tensors, train_meta=meta)
    run.health.last_saved = step


def _save_sharded(run: Run, tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """The save protocol with shards: rank 0 makes the temporary folder, every rank
    writes its shard into it, then rank 0 adds the JSON (config.json last) and renames
    it into place. Until that rename the previous latest/ is the checkpoint."""
    built, ctx = run.setup, run.setup.ctx
    tmp = new_temporary(built.latest) if ctx.is_main else None
    tmp = Path(distributed.broadcast_text(str(tmp), ctx))
    try:
        distributed.save_shards(distributed.sharded_state(built.raw, built.optimizer),
                                tmp / SHARDS_DIR, ctx)
        distributed.barrier(ctx)
        if ctx.is_main:
            sharded = {"strategy": built.strategy, "world_size": ctx.world_size}
            save_checkpoint(built.latest, built.raw, run.feed.data.tokenizer,
                            extra_config={**built.extra, "sharded": sharded},
                            train_tensors=tensors, train_meta=meta, tmp=tmp)
    except BaseException:
        if ctx.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    distributed.barrier(ctx)


def _memory(run: Run, peak_rss: float | None) -> dict[str, list[float]]:
    """Per rank (MiB): the training state it holds (weights, gradients, optimizer state;
    a shard counts its local part) and the process's peak resident memory during the
    training steps (``peak_rss``; None: the peak so far)."""
    params = [p for p in run.setup.raw.parameters()]
    grads = [p for p in params if p.requires_grad]  # a gradient per trainable parameter
    inner = distributed.local_optimizer(run.setup.optimizer)
    moments = [v for st in inner.state.values() for v in st.values() if isinstance(v, Tensor)]
    mib = 1 / 2**20
    values = [distributed.local_bytes(params) * mib, distributed.local_bytes(grads) * mib,
              distributed.local_bytes(moments) * mib, (peak_rss or peak_rss_now()) * mib]
    rows = distributed.all_gather_floats(values, run.setup.ctx)
    names = ("weights_mib", "grads_mib", "optimizer_mib", "peak_rss_mib")
    return {name: [round(r[i], 3) for r in rows] for i, name in enumerate(names)}


def peak_rss_now() -> float:
    """Bytes: the peak resident set size of this process (0 where unknown)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return 0.0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(peak if sys.platform == "darwin" else peak * 1024)
