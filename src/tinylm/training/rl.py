"""``tinylm rl``: on-policy reinforcement learning from verifiable rewards.

Each step draws ``prompts_per_step`` training prompts of a task, samples
``group_size`` completions of each (:mod:`tinylm.training.rollout`), scores them with
the task's reward, turns the rewards into group-relative advantages and updates the
policy ``updates_per_batch`` times with the token-level clipped objective
(:mod:`tinylm.training.grpo`). With ``kl_coef`` > 0 a frozen copy of the starting model
is kept as the KL reference. LoRA (``lora_rank``) or full fine-tuning.

The run folder is train's (:mod:`tinylm.training.loop`): OUT/latest (weights, the
AdamW state, counters) written with the same save protocol, OUT/best (the highest
held-out pass@1), OUT/metrics.jsonl, OUT/loss.png (reward and loss curves), the folder
lock and ``--resume``. Every random draw of a step (which prompts, which samples) is
seeded by (seed, step), so a resumed run repeats the steps it would have taken: on CPU
a run killed and resumed ends bitwise equal to an uninterrupted one (time budgets
excepted). The learning rate is constant (RL recipes rarely decay it over so few steps).

Evaluation on the held-out prompts: pass@1 is *greedy* (temperature 0, one answer per
prompt: is it correct); pass@k draws k samples at the run's temperature per prompt and
uses the unbiased estimator (:func:`tinylm.use.rewards.pass_at_k`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tinylm.core.checks import check_int
from tinylm.core.config import TrainConfig
from tinylm.core.errors import ConfigError
from tinylm.io.checkpoint import (
    load_checkpoint,
    load_model,
    load_optimizer_state,
    load_train_state,
    optimizer_state,
    resolve_checkpoint_dir,
)
from tinylm.io.checkpoint_files import RUN_BEST, RUN_LATEST, WEIGHTS_FILE, save_checkpoint
from tinylm.io.files import FolderLock, sha256_file
from tinylm.layers.lora import apply_lora, is_adapter_key, merge_lora
from tinylm.training import distributed
from tinylm.training.defaults import RL_DEFAULTS, RL_LR
from tinylm.training.finetune import with_dropout
from tinylm.training.grpo import ADVANTAGES, group_advantages, policy_loss, token_logprobs
from tinylm.training.optim import build_optimizer
from tinylm.training.rlplot import plot_rl
from tinylm.training.rollout import pack, prompt_ids, sample
from tinylm.training.runfolder import find_run, prepare_out, resume_mode
from tinylm.training.runlog import MetricsLog, Progress, StopSignal
from tinylm.use.rewards import pass_at_k

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RLConfig:
    """The settings of one ``tinylm rl`` run (defaults: :data:`RL_DEFAULTS`)."""

    group_size: int = RL_DEFAULTS["group_size"]
    prompts_per_step: int = RL_DEFAULTS["prompts_per_step"]
    max_new_tokens: int = RL_DEFAULTS["max_new_tokens"]
    temperature: float = RL_DEFAULTS["temperature"]
    advantage: str = RL_DEFAULTS["advantage"]
    updates_per_batch: int = RL_DEFAULTS["updates_per_batch"]
    clip_eps: float = RL_DEFAULTS["clip_eps"]
    kl_coef: float = RL_DEFAULTS["kl_coef"]
    lora_rank: int | None = RL_DEFAULTS["lora_rank"]
    lora_alpha: float | None = RL_DEFAULTS["lora_alpha"]
    lr: float | None = RL_DEFAULTS["lr"]
    max_steps: int = RL_DEFAULTS["max_steps"]
    time_budget: float | None = RL_DEFAULTS["time_budget"]
    eval_every: int = RL_DEFAULTS["eval_every"]
    save_every: int = RL_DEFAULTS["save_every"]
    pass_k: int = RL_DEFAULTS["pass_k"]
    seed: int = RL_DEFAULTS["seed"]
    n_train: int = RL_DEFAULTS["n_train"]
    n_held_out: int = RL_DEFAULTS["n_held_out"]
    grad_clip: float = RL_DEFAULTS["grad_clip"]
    match: str = RL_DEFAULTS["match"]
    reward: str | None = RL_DEFAULTS["reward"]

    def __post_init__(self) -> None:
        for name in ("group_size", "prompts_per_step", "max_new_tokens",
                     "updates_per_batch", "max_steps", "eval_every", "save_every", "pass_k",
                     "n_train", "n_held_out"):
            check_int(name.replace("_", "-"), getattr(self, name), 1)
        check_int("seed", self.seed, 0)
        if self.lora_rank is not None:
            check_int("lora-rank", self.lora_rank, 1)
        if self.advantage not in ADVANTAGES:
            raise ConfigError(f"--advantage must be one of {', '.join(ADVANTAGES)}, got "
                              f"{self.advantage!r}")
        if self.group_size < 2:
            raise ConfigError("--group-size must be at least 2: the advantage compares a "
                              "completion with the others of its group")
        _positive("temperature", self.temperature, allow_zero=False)
        _positive("clip-eps", self.clip_eps, allow_zero=False)
        _positive("kl-coef", self.kl_coef)
        _positive("grad-clip", self.grad_clip)
        if self.lr is not None:
            _positive("lr", self.lr, allow_zero=False)
        if self.time_budget is not None:
            _positive("time-budget", self.time_budget, allow_zero=False)

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else RL_LR[self.lora_rank is not None]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _positive(name: str, value: Any, allow_zero: bool = True) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        raise ConfigError(f"--{name} must be a finite number {'>= 0' if allow_zero else '> 0'}"
                          f", got {value!r}")


@dataclass
class Policy:
    """The model being trained, its tokenizer, the optimizer, the KL reference."""

    model: nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    params: list[torch.Tensor]
    ref: nn.Module | None
    extra: dict[str, Any]


def _start_model(model_dir: str | os.PathLike, cfg: RLConfig) -> tuple[nn.Module, Any]:
    model, tok = load_checkpoint(model_dir)
    if tok is None:
        raise ConfigError(f"{model_dir} has no tokenizer; tinylm rl needs a chat model")
    if any(is_adapter_key(n) for n, _ in model.named_parameters()):
        model = merge_lora(model)  # a LoRA run: start from its merged weights
    return with_dropout(model, 0.0).train(), tok


def build_policy(model_dir: str | os.PathLike, cfg: RLConfig, latest: Path | None
                 ) -> Policy:
    """The starting model (LoRA put on it, seeded), or latest/'s weights when
    resuming; the optimizer (AdamW, no weight decay); the reference when kl_coef > 0."""
    torch.manual_seed(cfg.seed)
    model, tok = _start_model(model_dir, cfg)
    ref = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    extra: dict[str, Any] = {"rl": {**cfg.to_dict(), "base": str(Path(model_dir).resolve())}}
    if cfg.lora_rank is not None:
        apply_lora(model, cfg.lora_rank, cfg.lora_alpha)
        weights = resolve_checkpoint_dir(model_dir) / WEIGHTS_FILE
        extra["lora_base"] = {"path": str(resolve_checkpoint_dir(model_dir).resolve()),
                              "sha256": sha256_file(weights), "grown": False}
    if latest is not None:
        saved = load_model(latest)
        model.load_state_dict(saved.state_dict())
    model.train()
    tc = TrainConfig.from_dict({"lr": cfg.learning_rate, "weight_decay": 0.0,
                                "optimizer": "adamw"})
    optimizer = build_optimizer(model, tc, torch.device("cpu"))
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return Policy(model, tok, optimizer, params, ref, extra)


def _choose(n: int, k: int, seed: int, step: int) -> list[int]:
    """``k`` training prompt indices for ``step``, drawn afresh from (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, n, (k,), generator=g).tolist()


def rl_step(policy: Policy, task: Any, cfg: RLConfig, step: int) -> dict[str, Any]:
    """One step: sample, score, update ``updates_per_batch`` times. Returns its record."""
    t0 = time.perf_counter()
    records = [task.train[i] for i in _choose(len(task.train), cfg.prompts_per_step,
                                              cfg.seed, step)]
    prompts = [prompt_ids(policy.tokenizer, r.prompt) for r in records]
    groups = sample(policy.model, policy.tokenizer, prompts, cfg.group_size,
                    max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature,
                    seed=cfg.seed * 7919 + step, stop_strings=_stops(task))
    rewards = torch.tensor([[float(task.reward(r, s.text)) for s in g]
                            for r, g in zip(records, groups, strict=True)])
    t_gen = time.perf_counter() - t0
    adv = group_advantages(rewards, cfg.advantage).reshape(-1)
    flat = [s for g in groups for s in g]
    batch = pack(flat)
    stats = _update(policy, batch, adv, cfg)
    return {"step": step + 1, "reward_mean": rewards.mean().item(),
            "reward_std": rewards.std(unbiased=False).item(),
            "response_length": sum(len(s.tokens) for s in flat) / len(flat),
            **stats, "samples_per_s": len(flat) / (time.perf_counter() - t0),
            "generate_s": t_gen, "update_s": time.perf_counter() - t0 - t_gen}


def _stops(task: Any) -> list[str]:
    stop = getattr(task, "stop", None) or ()
    return [stop] if isinstance(stop, str) else list(stop)


def _update(policy: Policy, batch: Any, adv: torch.Tensor, cfg: RLConfig) -> dict[str, float]:
    """The policy updates of one batch; the first update's statistics."""
    ref_logp = None
    if policy.ref is not None:
        with torch.no_grad():
            ref_logp, _ = token_logprobs(policy.ref(batch.seq), batch.seq)
    old_logp, first = None, {}
    n = batch.mask.sum().clamp(min=1.0)
    for u in range(cfg.updates_per_batch):
        logp, entropy = token_logprobs(policy.model(batch.seq), batch.seq)
        if old_logp is None:
            old_logp = logp.detach()  # the sampling policy: the ratio starts at exactly 1
        parts = policy_loss(logp, old_logp, adv, batch.mask, clip_eps=cfg.clip_eps,
                            ref_logp=ref_logp, kl_coef=cfg.kl_coef)
        policy.optimizer.zero_grad(set_to_none=True)
        parts.loss.backward()
        clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        gnorm = torch.nn.utils.clip_grad_norm_(policy.params, clip)
        if not (torch.isfinite(parts.loss) and torch.isfinite(gnorm)):
            raise ConfigError("the RL loss or gradient became non-finite; lower --lr")
        policy.optimizer.step()
        if u == 0:
            first = {"loss": parts.loss.item(), "kl": parts.kl.item(),
                     "entropy": ((entropy.detach() * batch.mask).sum() / n).item(),
                     "grad_norm": gnorm.item()}
        first["clip_fraction"] = parts.clip_fraction.item()  # the last update's
    policy.optimizer.zero_grad(set_to_none=True)
    return first


def held_out(policy: Policy, task: Any, cfg: RLConfig, k: int | None = None
             ) -> dict[str, float]:
    """Greedy pass@1 and mean reward on the held-out prompts; with ``k``, also pass@k
    from k samples per prompt at the run's temperature."""
    model = policy.model
    recs = list(task.held_out)
    prompts = [prompt_ids(policy.tokenizer, r.prompt) for r in recs]
    greedy = sample(model, policy.tokenizer, prompts, 1, max_new_tokens=cfg.max_new_tokens,
                    temperature=0.0, seed=cfg.seed, stop_strings=_stops(task))
    texts = [g[0].text for g in greedy]
    out = {"heldout_pass1": sum(bool(task.correct(r, t)) for r, t in zip(recs, texts,
                                                                         strict=True))
           / len(recs),
           "heldout_reward": sum(float(task.reward(r, t)) for r, t in zip(recs, texts,
                                                                          strict=True))
           / len(recs)}
    if k is not None:
        drawn = sample(model, policy.tokenizer, prompts, k, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, seed=cfg.seed + 1,
                       stop_strings=_stops(task))
        correct = [sum(bool(task.correct(r, s.text)) for s in g) for r, g in
                   zip(recs, drawn, strict=True)]
        out[f"heldout_pass{k}"] = sum(pass_at_k(k, c, k) for c in correct) / len(recs)
    model.train()
    return out


# --- the run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class RLResult:
    """What :func:`rl` achieved: the steps, why it stopped, held-out before/after."""

    out_dir: Path
    steps: int
    stop_reason: str
    before: dict[str, float]
    after: dict[str, float]
    best_pass1: float
    elapsed: float
    resumed_from: int | None = None

    @property
    def checkpoint(self) -> Path:
        return self.out_dir / RUN_LATEST


def _save(policy: Policy, out: Path, step: int, meta: dict[str, Any]) -> None:
    """OUT/latest: the weights (adapters only with LoRA), the optimizer, the counters."""
    tensors, opt_meta = optimizer_state(policy.optimizer)
    tensors["rng.torch.0"] = torch.get_rng_state()
    save_checkpoint(out / RUN_LATEST, policy.model, policy.tokenizer,
                    extra_config=policy.extra, train_tensors=tensors,
                    train_meta={**meta, "step": step, "optimizer": opt_meta,
                                "world_size": 1})


def _restore(policy: Policy, out: Path) -> dict[str, Any]:
    tensors, meta = load_train_state(out / RUN_LATEST)
    load_optimizer_state(policy.optimizer, tensors, meta["optimizer"])
    torch.set_rng_state(tensors["rng.torch.0"])
    return meta


def load_task(task: Any, cfg: RLConfig) -> Any:
    """A task object as given, or one loaded from its spec (tinylm.use.rewards)."""
    if not isinstance(task, (str, os.PathLike)):
        return task
    from tinylm.use.rewards import load_rl_task

    return load_rl_task(str(task), seed=cfg.seed, n_train=cfg.n_train,
                        n_held_out=cfg.n_held_out, reward=cfg.reward, match=cfg.match)


@dataclass
class _Loop:
    policy: Policy
    task: Any
    cfg: RLConfig
    out: Path
    metrics: MetricsLog
    bar: Progress
    step: int
    best: float
    elapsed0: float
    before: dict[str, float]
    on_step: Any = None


def _evaluate(run: _Loop, k: int | None = None) -> dict[str, float]:
    scores = held_out(run.policy, run.task, run.cfg, k)
    if scores["heldout_pass1"] > run.best:
        run.best = scores["heldout_pass1"]
        save_checkpoint(run.out / RUN_BEST, run.policy.model, run.policy.tokenizer,
                        extra_config={**run.policy.extra, "best": {
                            "step": run.step, "heldout_pass1": run.best}})
    return scores


def _meta(run: _Loop, t0: float, reason: str | None) -> dict[str, Any]:
    return {"best_pass1": run.best, "elapsed": run.elapsed0 + time.perf_counter() - t0,
            "stop_reason": reason, "before": run.before}


def _steps(run: _Loop, signal: StopSignal, t0: float) -> str:
    """Step until max_steps, the time budget or a stop signal; returns why it stopped."""
    cfg = run.cfg
    while run.step < cfg.max_steps:
        if signal.received is not None:
            return "interrupted"
        spent = run.elapsed0 + time.perf_counter() - t0
        if cfg.time_budget is not None and spent >= cfg.time_budget:
            return "time_budget"
        record = rl_step(run.policy, run.task, cfg, run.step)
        run.step += 1
        run.bar.step()
        if run.on_step is not None:
            run.on_step(run.step)
        if run.step % cfg.eval_every == 0 and run.step < cfg.max_steps:
            record.update(_evaluate(run))
            run.bar.message(f"step {run.step}: held-out pass@1 {record['heldout_pass1']:.3f}"
                            f" (greedy), train reward {record['reward_mean']:.3f}")
        record["elapsed"] = run.elapsed0 + time.perf_counter() - t0
        run.metrics.write(record)
        _report(run.bar, record, cfg.max_steps)
        if run.step % cfg.save_every == 0:
            _save(run.policy, run.out, run.step, _meta(run, t0, None))
    return "max_steps"


def _report(bar: Progress, record: dict[str, Any], total: int) -> None:
    """The bar's postfix on a terminal, else one log line per step."""
    if bar.bar is not None:
        bar.bar.set_postfix(reward=f"{record['reward_mean']:.3f}",
                            len=f"{record['response_length']:.1f}",
                            samples_s=f"{record['samples_per_s']:.2f}", refresh=False)
    elif bar.enabled:
        log.info("step %d/%d | reward %.3f | length %.1f | kl %.4f | entropy %.3f | "
                 "%.2f samples/s", record["step"], total, record["reward_mean"],
                 record["response_length"], record["kl"], record["entropy"],
                 record["samples_per_s"])


def _run(model_dir: Any, task: Any, cfg: RLConfig, out: Path, resuming: bool,
         progress: bool | None, on_step: Any) -> RLResult:
    policy = build_policy(model_dir, cfg, out / RUN_LATEST if resuming else None)
    meta = _restore(policy, out) if resuming else {}
    step = int(meta.get("step", 0))
    metrics = MetricsLog(out, True, step if resuming else None)
    run = _Loop(policy, task, cfg, out, metrics, Progress(True, progress), step,
                float(meta.get("best_pass1", -1.0)), float(meta.get("elapsed", 0.0)),
                dict(meta.get("before") or {}), on_step)
    t0 = time.perf_counter()
    signal = StopSignal()
    with signal.installed(), contextlib.closing(metrics), contextlib.closing(run.bar):
        if not resuming:
            run.before = _evaluate(run, cfg.pass_k)
            metrics.write({"step": 0, **run.before, "before": True, "elapsed": 0.0})
        log.info("held-out before: %s", _fmt(run.before))
        run.bar.open(run.step, cfg.max_steps)
        reason = _steps(run, signal, t0)
        run.bar.close()
        after: dict[str, float] = {}
        if reason != "interrupted":
            after = _evaluate(run, cfg.pass_k)
            metrics.write({"step": run.step, **after, "final": True,
                           "elapsed": run.elapsed0 + time.perf_counter() - t0})
        _save(policy, out, run.step, _meta(run, t0, reason))
        plot_rl(metrics.records, out)
    return RLResult(out, run.step, reason, run.before, after, run.best,
                    run.elapsed0 + time.perf_counter() - t0, step if resuming else None)


def _fmt(scores: dict[str, float]) -> str:
    return ", ".join(f"{k.removeprefix('heldout_')} {v:.3f}" for k, v in scores.items())


def rl(model_dir: str | os.PathLike, task: Any, out_dir: str | os.PathLike, *,
       config: RLConfig | None = None, resume: bool | str | None = False,
       progress: bool | None = None, on_step: Any = None) -> RLResult:
    """Train ``model_dir`` with RL on ``task`` (a spec for
    :func:`tinylm.use.rewards.load_rl_task`, or a task object) into ``out_dir``.
    ``resume``: as :func:`tinylm.train` (False, True, "auto"). ``on_step(step)`` runs
    after every step."""
    cfg = config or RLConfig()
    out = Path(out_dir)
    task = load_task(task, cfg)
    prepare_out(out)
    lock = FolderLock(out).acquire()
    try:
        start, _ = load_checkpoint(model_dir)
        found = find_run(out, resume_mode(resume), distributed.DistContext(),
                         with_dropout(start, 0.0).config)
        if found.resuming and (found.meta or {}).get("stop_reason") in ("max_steps",) \
                and int(found.step or 0) >= cfg.max_steps:
            meta = found.meta or {}
            return RLResult(out, int(found.step or 0), "finished", meta.get("before", {}),
                            {}, float(meta.get("best_pass1", 0.0)),
                            float(meta.get("elapsed", 0.0)), found.step)
        return _run(model_dir, task, cfg, out, found.resuming, progress, on_step)
    finally:
        lock.release()


__all__ = ["RLConfig", "RLResult", "build_policy", "held_out", "load_task", "rl", "rl_step"]
