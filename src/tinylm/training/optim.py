"""Optimizers and the learning-rate schedule of :func:`tinylm.training.train`.

* AdamW with decoupled weight decay on weight *matrices* only: every 2-D parameter
  that is not an embedding table (attention qkv/out, FFN up/down, low-rank factors).
  Biases, LayerNorm gains and the token/positional embeddings are not decayed: they
  are not "capacity" that decay should shrink, and the token embedding doubles as the
  tied LM head, whose rows for rare tokens would otherwise be decayed to zero.
* Muon (:class:`MuonAdamW`) on the blocks' weight matrices, AdamW on the rest.
* Learning rate: linear warm-up, then a cosine to ``lr * min_lr_ratio`` (:func:`lr_at`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from tinylm.core.config import TrainConfig
from tinylm.core.errors import ConfigError
from tinylm.training import distributed

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
    One lr drives both parts, so the warm-up/cosine schedule of
    :func:`tinylm.training.train` applies unchanged; the state is an ordinary
    ``state_dict`` (checkpoints and resume work).
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

