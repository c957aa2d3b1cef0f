"""The math of ``tinylm rl``: group-relative advantages, the clipped policy-gradient
objective with an optional KL penalty, and the per-token log-probabilities it needs.

Each prompt gets G sampled completions (a *group*). A completion's advantage is its
reward minus the group's mean reward (``"mean"``), optionally divided by the group's
standard deviation plus ``eps`` (``"std"``, GRPO). Every completion token ``t`` then
carries the objective of PPO/GRPO::

    ratio_t = exp(logp_t - old_logp_t)
    pg_t    = -min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)
    kl_t    = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      (the k3 estimator)
    loss_t  = pg_t + kl_coef * kl_t

``old_logp`` are the log-probabilities of the policy that sampled the batch. With one
update per batch it is the current policy detached, so the ratio is exactly 1 and the
gradient is REINFORCE's ``A * grad logp_t`` with the group mean as baseline.

Normalisation: the loss is the sum of ``loss_t`` over every completion token of the
batch divided by the number of completion tokens (token-level, as DAPO and nanochat),
so long and short answers weigh the same per token. The mask keeps the prompt and the
padding after a completion's stop token out of the sum, and so out of the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn import functional as F

from tinylm.core.errors import ConfigError

#: The ways to turn a group's rewards into advantages.
ADVANTAGES = ("mean", "std")


def group_advantages(rewards: Tensor, mode: str = "mean", eps: float = 1e-6) -> Tensor:
    """(P, G) rewards -> (P, G) advantages: reward - group mean, and with ``"std"``
    divided by (the group's population standard deviation + ``eps``)."""
    if mode not in ADVANTAGES:
        raise ConfigError(f"advantage must be one of {', '.join(ADVANTAGES)}, got {mode!r}")
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if mode == "std":
        adv = adv / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)
    return adv


def token_logprobs(logits: Tensor, seq: Tensor) -> tuple[Tensor, Tensor]:
    """(N, T, V) logits of ``seq`` (N, T) -> (log p(seq[:, t] | seq[:, :t]), the entropy
    of that next-token distribution), both (N, T - 1) for t = 1..T-1."""
    logp_all = F.log_softmax(logits[:, :-1].float(), dim=-1)
    logp = logp_all.gather(-1, seq[:, 1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


@dataclass(frozen=True)
class LossParts:
    """The loss and what it is made of (means over the completion tokens)."""

    loss: Tensor
    kl: Tensor
    clip_fraction: Tensor


def policy_loss(logp: Tensor, old_logp: Tensor, adv: Tensor, mask: Tensor, *,
                clip_eps: float = 0.2, ref_logp: Tensor | None = None,
                kl_coef: float = 0.0) -> LossParts:
    """The token-level clipped objective over ``mask``ed tokens (see the module).

    ``logp``, ``old_logp``, ``ref_logp``, ``mask``: (N, L); ``adv``: (N,), one value per
    completion. Returns the loss (sum over the masked tokens / their number), the mean
    k3 KL to the reference (0 without one) and the share of tokens whose ratio was
    clipped."""
    m = mask.to(logp.dtype)
    n = m.sum().clamp(min=1.0)
    ratio = torch.exp(logp - old_logp)
    a = adv[:, None].to(logp.dtype)
    clipped = torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps)
    per_token = -torch.minimum(ratio * a, clipped * a)
    kl = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if ref_logp is not None and kl_coef > 0:
        d = ref_logp - logp
        k3 = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * k3
        kl = (k3 * m).sum() / n
    was_clipped = ((ratio - clipped).abs() > 0).to(logp.dtype)
    return LossParts(loss=(per_token * m).sum() / n, kl=kl.detach(),
                     clip_fraction=((was_clipped * m).sum() / n).detach())


__all__ = ["ADVANTAGES", "LossParts", "group_advantages", "policy_loss", "token_logprobs"]
