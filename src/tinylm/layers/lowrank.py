"""Low-rank factorisation (docs/compress.md): W ≈ W1·W2, applied to a whole model.

The seed's idea: a weight W of shape (E, F) (the layer computes x·W, E -> F) is replaced
by two thin matrices W1 (E, r) and W2 (r, F), so that x·W1·W2 ≈ x·W. Parameters go from
E·F to r·(E + F); the seed's example, E = F = 100 and r = 10, goes from 10,000 to 2,000,
80 % fewer (the note writes 1,000,000 for the 100×100 matrix; 10,000 is right).

The factorisation is an approximation. The best rank-r one in Frobenius norm is the
truncated SVD (Eckart–Young): with W = U·diag(σ)·Vᵀ and σ sorted in decreasing order,

    W1 = U[:, :r]·diag(√σ[:r])      (E, r)
    W2 = diag(√σ[:r])·V[:, :r]ᵀ     (r, F)
    ‖W - W1·W2‖_F = sqrt(Σ_{i>r} σ_i²)

√σ is split into both factors so they have the same scale (neither is ill-conditioned
when the pair is fine-tuned afterwards). A factorisation only pays when it saves
parameters: r·(E + F) < E·F, i.e. r < E·F / (E + F) (r < E/2 for a square matrix).

Orientation: everything here uses the seed's x·W (in, out) orientation. ``nn.Linear``
stores the transpose, weight (out, in) = Wᵀ; :func:`dense_weight` hides that.

How ranks are chosen by :func:`tinylm.commands.compress.compress` (one of three modes;
the command, its reports and sweeps live there, this module is the layer and its math):

- ``rank=R``: every chosen layer gets rank R (skipped where R would not save parameters).
- ``energy=F``: each layer independently gets the smallest r that keeps a share F of
  its Σσ² (:func:`rank_for_energy`); relative Frobenius error is then ≤ sqrt(1 - F).
- ``params_fraction=P``: a global budget, the whole model (embeddings included) keeps at
  most P of its parameters. Every factorised layer keeps its largest singular value;
  then singular values of all chosen layers are taken greedily in decreasing order of
  *relative energy per parameter*, σ_i² / ‖W‖_F² / (E + F), while they fit the budget
  (:func:`ranks_for_budget`). A layer whose chosen rank would not save parameters is
  left as it is, and the greedy pass is repeated with the budget that frees up.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.checks import check_fraction
from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.layers.defaults import DEFAULT_LAYERS as DEFAULT_LAYERS  # compress's defaults
from tinylm.layers.dense import dense_linear, replace_named_layers

# --- the math as small pure functions ---------------------------------------------------


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run an SVD single-threaded: for weight-sized matrices threading gains little, and on
    a busy CPU the threaded LAPACK path was measured ~300x slower (0.07 s vs 0.0002 s for
    a 32x96 matrix on 2 loaded cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def singular_values(W: Tensor) -> Tensor:
    """σ of W (any 2-D shape), in float64, sorted in decreasing order: (min(E, F),)."""
    with _one_thread():
        return torch.linalg.svdvals(W.detach().to("cpu", torch.float64))


def factorize(W: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """Best rank-``rank`` factorisation of W (E, F): (W1 (E, r), W2 (r, F)), W ≈ W1·W2.

    Truncated SVD with √σ in each factor; the Frobenius error is sqrt(Σ discarded σ²)
    (Eckart–Young). Computed in float64 on the CPU, returned in W's dtype and device.
    """
    if W.dim() != 2:
        raise ValueError(f"factorize needs a 2-D matrix, got shape {tuple(W.shape)}")
    full = min(W.shape)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full:
        raise ConfigError(f"rank must be an integer in [1, {full}] for a matrix of shape "
                          f"{tuple(W.shape)}, got {rank!r}")
    with _one_thread():
        U, S, Vh = torch.linalg.svd(W.detach().to("cpu", torch.float64), full_matrices=False)
    root = S[:rank].sqrt()  # (r,)
    W1 = U[:, :rank] * root  # (E, r)·diag(√σ) -> (E, r)
    W2 = root[:, None] * Vh[:rank]  # diag(√σ)·(r, F) -> (r, F)
    return W1.to(W.dtype).to(W.device), W2.to(W.dtype).to(W.device)


def truncation_error(sigma: Tensor, rank: int) -> float:
    """Relative Frobenius error of the best rank-r approximation: sqrt(Σ_{i>r}σ²/Σσ²)."""
    energy = sigma.double().square()
    total = float(energy.sum())
    return math.sqrt(float(energy[rank:].sum()) / total) if total > 0 else 0.0


def energy_rank(sigma: Tensor, fraction: float) -> int:
    """Smallest r with Σ_{i≤r} σ_i² ≥ fraction·Σσ² (σ sorted decreasing), at least 1."""
    check_share("energy", fraction)
    energy = sigma.double().square()
    total = float(energy.sum())
    if total == 0.0:
        return 1
    kept = torch.cumsum(energy, 0) / total  # (n,), non-decreasing, last = 1
    # A relative tolerance of 1e-12 so that fraction=1.0 is not defeated by rounding.
    r = int(torch.searchsorted(kept, torch.tensor([fraction * (1 - 1e-12)],
                                                  dtype=kept.dtype)).item()) + 1
    return min(max(r, 1), sigma.numel())


def rank_for_energy(W: Tensor, fraction: float) -> int:
    """Smallest rank whose truncated SVD keeps ``fraction`` of W's energy Σσ²."""
    return energy_rank(singular_values(W), fraction)


def lowrank_params(in_features: int, out_features: int, rank: int, bias: bool = False) -> int:
    """Parameters of a rank-r factorised (E -> F) layer: r·(E + F), plus F for a bias."""
    return rank * (in_features + out_features) + (out_features if bias else 0)


def max_saving_rank(in_features: int, out_features: int) -> int:
    """Largest r with r·(E + F) < E·F, i.e. the largest rank that still saves parameters."""
    return (in_features * out_features - 1) // (in_features + out_features)


@dataclass(frozen=True)
class LayerSpectrum:
    """What the budget mode needs to know about one candidate layer.

    ``params`` is the layer's current weight count (E·F when dense, r0·(E + F) when
    already factorised); ``sigma`` its singular values, sorted decreasing.
    """

    name: str
    in_features: int
    out_features: int
    params: int
    sigma: Tensor


def ranks_for_budget(layers: Sequence[LayerSpectrum], budget: float) -> list[int | None]:
    """Per-layer ranks whose weights fit in ``budget`` parameters (None: leave as is).

    When the layers fit as they are, none is factorised. Otherwise every factorised
    layer keeps σ_1 (cost E + F); further singular values of all layers
    are taken greedily in decreasing σ_i²/‖W‖_F²/(E + F) (relative energy per parameter)
    while the total fits. A layer whose rank reaches the point where factorising stops
    saving parameters is left as is (its current cost is at most that of the rank), and
    the pass is repeated with the remaining layers and budget. Raises ConfigError when
    even rank 1 everywhere does not fit.
    """
    if budget >= sum(layer.params for layer in layers):
        return [None] * len(layers)  # everything fits as it is: approximate nothing
    keep: set[int] = set()  # indices left as they are
    while True:
        active = [i for i in range(len(layers)) if i not in keep]
        room = budget - sum(layers[i].params for i in keep)
        cost = {i: layers[i].in_features + layers[i].out_features for i in active}
        ranks = {i: 1 for i in active}
        spent = sum(cost.values())
        if spent > room:
            raise ConfigError(
                f"the parameter budget cannot be met: rank 1 in every chosen layer already "
                f"needs {spent:,} weights but only {max(int(room), 0):,} are left; choose a "
                f"larger --params-fraction or add layers with --layers")
        candidates = []
        for i in active:
            energy = layers[i].sigma.double().square()
            total = float(energy.sum()) or 1.0
            for k in range(1, energy.numel()):  # σ_{k+1}; σ_1 is always kept
                candidates.append((-float(energy[k]) / total / cost[i], i, k))
        candidates.sort()
        closed: set[int] = set()
        for _score, i, k in candidates:
            if i in closed or ranks[i] != k:
                continue
            if spent + cost[i] <= room:
                ranks[i] += 1
                spent += cost[i]
            else:
                closed.add(i)  # later σ of this layer cost the same and cannot fit either
        no_saving = {i for i in active if ranks[i] * cost[i] >= layers[i].params}
        if not no_saving:
            return [None if i in keep else ranks[i] for i in range(len(layers))]
        keep |= no_saving


def check_share(name: str, value: float) -> float:
    """``value`` if it is a fraction in (0, 1] (an energy share or a parameter share)."""
    return check_fraction(name, value, low=0, high=1, low_open=True, high_open=False,
                          hint="e.g. 0.5")


# --- the module ---------------------------------------------------------------------------


class LowRankLinear(nn.Module):
    """A factorised linear layer, y = x·W1·W2 + b: (…, E) -> (…, r) -> (…, F).

    ``W1`` (E, r) and ``W2`` (r, F) are in the seed's x·W orientation; ``bias`` (F,) is
    kept from the dense layer. Its state-dict keys (``<name>.W1``, ``<name>.W2``,
    ``<name>.bias``) go through the normal checkpoint path, and config.json records the
    ranks (``"lowrank"``) so the structure is rebuilt on load. Constructed weights are
    uninitialised: build one with :meth:`from_linear` or load a state dict into it.
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True,
                 device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.rank = rank
        kw = {"device": device, "dtype": dtype}
        self.W1 = nn.Parameter(torch.empty(in_features, rank, **kw))
        self.W2 = nn.Parameter(torch.empty(rank, out_features, **kw))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **kw))
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, layer: nn.Linear | LowRankLinear, rank: int) -> LowRankLinear:
        """The best rank-r replacement of a dense (or already factorised) layer."""
        W = dense_weight(layer)  # (E, F)
        W1, W2 = factorize(W, rank)
        new = cls(layer.in_features, layer.out_features, rank, bias=layer.bias is not None,
                  device=W.device, dtype=W.dtype)
        with torch.no_grad():
            new.W1.copy_(W1)
            new.W2.copy_(W2)
            if layer.bias is not None:
                new.bias.copy_(layer.bias)
        return new

    @property
    def weight(self) -> Tensor:
        """The equivalent dense weight in ``nn.Linear``'s (F, E) orientation, (W1·W2)ᵀ."""
        return (self.W1 @ self.W2).t()  # (E, r)·(r, F) -> (E, F) -> (F, E)

    def forward(self, x: Tensor) -> Tensor:
        h = F.linear(x, self.W1.t())  # (…, E)·(E, r) -> (…, r)
        return F.linear(h, self.W2.t(), self.bias)  # (…, r)·(r, F) + b -> (…, F)

    def to_linear(self) -> nn.Linear:
        """An ``nn.Linear`` holding the product W1·W2 (the same function, dense again)."""
        return dense_linear(self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, bias={self.bias is not None}")


def dense_weight(layer: nn.Linear | LowRankLinear) -> Tensor:
    """A layer's weight as one (E, F) matrix in the seed's x·W orientation (detached)."""
    if isinstance(layer, LowRankLinear):
        return (layer.W1 @ layer.W2).detach()  # (E, r)·(r, F) -> (E, F)
    return layer.weight.detach().t()  # nn.Linear stores (F, E)


def weight_params(layer: nn.Linear | LowRankLinear) -> int:
    """The weight count of a dense (E·F) or factorised (r·(E + F)) layer, bias excluded."""
    if isinstance(layer, LowRankLinear):
        return layer.W1.numel() + layer.W2.numel()
    return layer.weight.numel()


# --- model structure (tinylm.layers.registry: config.json's "lowrank") --------------------


def structure_of(model: nn.Module) -> dict[str, int]:
    """{module name: rank} of every LowRankLinear in ``model``; empty when none."""
    return {name: m.rank for name, m in model.named_modules() if isinstance(m, LowRankLinear)}

def apply_structure(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    """Replace the named Linear layers of ``model`` by uninitialised LowRankLinear ones.

    ``ranks`` is config.json's "lowrank" entry, e.g. {"blocks.0.attn.qkv": 24}. Used when
    loading a compressed checkpoint: the state dict then fills W1, W2 and bias.
    """
    def build(layer: nn.Module, name: str, rank: Any) -> LowRankLinear:
        full = min(layer.in_features, layer.out_features)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full:
            raise CheckpointError(f"config.json gives {name!r} rank {rank!r}, outside "
                                  f"[1, {full}]; the checkpoint is corrupt")
        ref = layer.W1 if isinstance(layer, LowRankLinear) else layer.weight
        return LowRankLinear(layer.in_features, layer.out_features, rank,
                             bias=layer.bias is not None, device=ref.device, dtype=ref.dtype)
    return replace_named_layers(model, ranks, "lowrank", LowRankLinear, build)
