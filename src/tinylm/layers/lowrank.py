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

How ranks are chosen by :func:`compress` (one of three modes):

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
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.errors import CheckpointError, ConfigError
from tinylm.use.plotting import figure_path, new_figure, save_figure

log = logging.getLogger(__name__)

#: ffn.gate exists only in a gated (SwiGLU) MLP; a default kind the model lacks is skipped.
DEFAULT_LAYERS: tuple[str, ...] = ("attn.qkv", "attn.out", "ffn.gate", "ffn.up", "ffn.down")


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
    _check_fraction("energy", fraction)
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


def _check_fraction(name: str, value: float) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not (ok and 0.0 < value <= 1.0):
        raise ConfigError(f"{name} must be a fraction in (0, 1], got {value!r}; e.g. 0.5")


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

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"rank={self.rank}, bias={self.bias is not None}")


def dense_weight(layer: nn.Linear | LowRankLinear) -> Tensor:
    """A layer's weight as one (E, F) matrix in the seed's x·W orientation (detached)."""
    if isinstance(layer, LowRankLinear):
        return (layer.W1 @ layer.W2).detach()  # (E, r)·(r, F) -> (E, F)
    return layer.weight.detach().t()  # nn.Linear stores (F, E)


def _weight_params(layer: nn.Linear | LowRankLinear) -> int:
    if isinstance(layer, LowRankLinear):
        return layer.W1.numel() + layer.W2.numel()
    return layer.weight.numel()


# --- model structure (used by checkpoint.py) ----------------------------------------------


def structure_of(model: nn.Module) -> dict[str, int]:
    """{module name: rank} of every LowRankLinear in ``model``; empty when none."""
    return {name: m.rank for name, m in model.named_modules() if isinstance(m, LowRankLinear)}



def apply_structure(model: nn.Module, ranks: dict[str, int]) -> nn.Module:
    """Replace the named Linear layers of ``model`` by uninitialised LowRankLinear ones.

    ``ranks`` is config.json's "lowrank" entry, e.g. {"blocks.0.attn.qkv": 24}. Used when
    loading a compressed checkpoint: the state dict then fills W1, W2 and bias.
    """
    if not isinstance(ranks, dict):
        raise CheckpointError(f"config.json's \"lowrank\" entry must map layer names to "
                              f"ranks, got {ranks!r}; the checkpoint is corrupt")
    for name, rank in ranks.items():
        try:
            layer = model.get_submodule(name)
        except AttributeError:
            layer = None
        if not isinstance(layer, (nn.Linear, LowRankLinear)):
            raise CheckpointError(f"config.json's \"lowrank\" entry names {name!r}, which is "
                                  f"not a linear layer of this model; the checkpoint is "
                                  f"corrupt or mixes files from different models")
        full = min(layer.in_features, layer.out_features)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= full:
            raise CheckpointError(f"config.json gives {name!r} rank {rank!r}, outside "
                                  f"[1, {full}]; the checkpoint is corrupt")
        ref = layer.W1 if isinstance(layer, LowRankLinear) else layer.weight
        model.set_submodule(name, LowRankLinear(
            layer.in_features, layer.out_features, rank, bias=layer.bias is not None,
            device=ref.device, dtype=ref.dtype))
    return model


# --- compress a model ---------------------------------------------------------------------


@dataclass(frozen=True)
class LayerReport:
    """One candidate layer: shape (E -> F), rank kept (None: left as is), cost, error."""

    name: str
    in_features: int
    out_features: int
    rank: int | None
    full_rank: int
    params_before: int
    params_after: int
    rel_error: float
    note: str = ""

    @property
    def factorised(self) -> bool:
        return self.rank is not None


@dataclass(frozen=True)
class CompressReport:
    """What :func:`compress` did: per layer, and totals for the whole model.

    Parameters count distinct tensors (a tied LM head once) including biases; bytes are
    the weights' payload as stored in model.safetensors (the file adds a small header).
    """

    mode: str
    layers: tuple[LayerReport, ...]
    params_before: int
    params_after: int
    bytes_before: int
    bytes_after: int

    @property
    def params_fraction(self) -> float:
        """Share of the parameters kept, params_after / params_before."""
        return self.params_after / self.params_before

    @property
    def reduction(self) -> float:
        """Share of parameters removed, in percent."""
        return 100.0 * (1.0 - self.params_fraction)

    @property
    def structure(self) -> dict[str, int]:
        return {r.name: r.rank for r in self.layers if r.rank is not None}


def _payload_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def select_layers(model: nn.Module, layers: Sequence[str] = DEFAULT_LAYERS
                  ) -> list[tuple[str, nn.Linear | LowRankLinear]]:
    """The linear layers that ``layers`` names, in model order.

    A name matches a module whose full name equals it or ends with "." + name, so
    "ffn.up" selects every block's FFN up-projection and "blocks.0.attn.qkv" one layer.
    The LM head is never a candidate (it is usually tied to the token embedding).
    """
    if isinstance(layers, str):
        layers = [layers]
    linear = [(n, m) for n, m in model.named_modules()
              if isinstance(m, (nn.Linear, LowRankLinear)) and not n.startswith("lm_head")]
    chosen, seen = [], set()
    for pattern in layers:
        pattern = pattern.strip()
        hits = [(n, m) for n, m in linear if n == pattern or n.endswith("." + pattern)]
        if not hits and pattern in DEFAULT_LAYERS and len(layers) > 1:
            continue  # a kind this architecture lacks (ffn.gate without SwiGLU)
        if not pattern or not hits:
            kinds = sorted({n.split(".", 2)[-1] for n, _ in linear})
            raise ConfigError(f"unknown layer name {pattern!r}; choose from "
                              f"{', '.join(kinds)} (or a full name like {linear[0][0]})"
                              if linear else f"unknown layer name {pattern!r}: the model has "
                              f"no linear layers to compress")
        for n, m in hits:
            if n not in seen:
                seen.add(n)
                chosen.append((n, m))
    order = {n: i for i, (n, _) in enumerate(linear)}
    return sorted(chosen, key=lambda nm: order[nm[0]])


def compress(
    model: nn.Module,
    *,
    rank: int | None = None,
    energy: float | None = None,
    params_fraction: float | None = None,
    layers: Sequence[str] = DEFAULT_LAYERS,
) -> CompressReport:
    """Factorise the chosen linear layers of ``model`` in place; return a report.

    Exactly one of ``rank`` (every layer gets rank R), ``energy`` (each layer keeps that
    share of its Σσ²) or ``params_fraction`` (the whole model keeps at most that share of
    its parameters; ranks by :func:`ranks_for_budget`) must be given. ``layers`` are name
    patterns (see :func:`select_layers`). A layer is only factorised when that saves
    parameters, r·(E + F) < its current weight count; otherwise it is left as is and the
    report says why. Already factorised layers (a compressed model) can be compressed
    again. In place, as ``torch.nn.utils.prune`` does: ``copy.deepcopy`` first to keep
    the original.
    """
    if isinstance(layers, str):
        layers = [layers]
    _check_mode(rank, energy, params_fraction)
    chosen = select_layers(model, layers)
    if rank is not None:
        too_big = [(n, m) for n, m in chosen if rank > min(m.in_features, m.out_features)]
        if too_big:
            n, m = too_big[0]
            full = min(m.in_features, m.out_features)
            raise ConfigError(
                f"rank {rank} is above the full rank {full} of {n} ({m.in_features}->"
                f"{m.out_features}); choose --rank below "
                f"{max_saving_rank(m.in_features, m.out_features) + 1} to save parameters")

    params_before = sum(p.numel() for p in model.parameters())
    bytes_before = _payload_bytes(model)
    spectra = [LayerSpectrum(n, m.in_features, m.out_features, _weight_params(m),
                             singular_values(dense_weight(m))) for n, m in chosen]

    if rank is not None:
        mode = f"rank={rank}"
        wanted: list[int | None] = [rank] * len(chosen)
    elif energy is not None:
        mode = f"energy={energy:g}"
        wanted = [energy_rank(s.sigma, energy) for s in spectra]
    else:
        mode = f"params_fraction={params_fraction:g}"
        fixed = params_before - sum(s.params for s in spectra)
        floor = fixed + sum(s.in_features + s.out_features for s in spectra)
        if params_fraction * params_before < floor:
            raise ConfigError(
                f"params fraction {params_fraction:g} cannot be reached by factorising "
                f"{', '.join(layers)}: even rank 1 everywhere keeps {floor / params_before:.3f} "
                f"of the {params_before:,} parameters (embeddings and other layers stay); "
                f"choose a fraction >= {math.ceil(floor / params_before * 1000) / 1000:g}")
        wanted = ranks_for_budget(spectra, params_fraction * params_before - fixed)

    rows = _factorise(model, chosen, spectra, wanted)
    params_after = sum(p.numel() for p in model.parameters())
    return CompressReport(mode, tuple(rows), params_before, params_after, bytes_before,
                          _payload_bytes(model))


def _check_mode(rank: int | None, energy: float | None, params_fraction: float | None) -> None:
    given = [k for k, v in (("rank", rank), ("energy", energy),
                            ("params_fraction", params_fraction)) if v is not None]
    if len(given) != 1:
        raise ConfigError(f"choose exactly one of rank, energy or params_fraction "
                          f"(--rank, --energy, --params-fraction), got "
                          f"{', '.join(given) or 'none'}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or rank < 1):
        raise ConfigError(f"rank must be an integer >= 1, got {rank!r}; e.g. --rank 16")
    if energy is not None:
        _check_fraction("energy", energy)
    if params_fraction is not None:
        _check_fraction("params fraction", params_fraction)


def _factorise(model: nn.Module, chosen: list[tuple[str, nn.Module]],
               spectra: list[LayerSpectrum], wanted: list[int | None]) -> list[LayerReport]:
    """Replace each chosen layer by its rank-r factorisation where that saves parameters;
    one report row per layer."""
    rows = []
    for (name, layer), spec, r in zip(chosen, spectra, wanted, strict=True):
        E, Fo, full = spec.in_features, spec.out_features, min(spec.in_features,
                                                                 spec.out_features)
        bias = 0 if layer.bias is None else layer.bias.numel()
        before = spec.params + bias
        if r is not None and r * (E + Fo) >= spec.params:
            note = (f"kept: rank {r} would not save parameters "
                    f"(needs rank <= {max_saving_rank(E, Fo)})"
                    if isinstance(layer, nn.Linear) else
                    f"kept: already rank {layer.rank}")
            r = None
        elif r is None:
            note = "kept: factorising would not save parameters at this budget"
        else:
            note = ""
        if r is None:
            rows.append(LayerReport(name, E, Fo, None, full, before, before, 0.0, note))
            continue
        model.set_submodule(name, LowRankLinear.from_linear(layer, r))
        rows.append(LayerReport(name, E, Fo, r, full, before, lowrank_params(E, Fo, r, False)
                                + bias, truncation_error(spec.sigma, r)))
        log.debug("factorised %s (%d->%d) at rank %d", name, E, Fo, r)
    return rows


def format_report(report: CompressReport) -> str:
    """The report as a fixed-width table plus totals, for printing."""
    lines = [f"compress ({report.mode})",
             f"{'layer':<22} {'shape':>11} {'rank':>9} {'params before':>14} "
             f"{'params after':>13} {'rel. error':>10}"]
    for r in report.layers:
        shape = f"{r.in_features}x{r.out_features}"
        rank = f"{r.rank}/{r.full_rank}" if r.rank is not None else f"-/{r.full_rank}"
        lines.append(f"{r.name:<22} {shape:>11} {rank:>9} {r.params_before:>14,} "
                     f"{r.params_after:>13,} {r.rel_error:>10.4f}"
                     + (f"  {r.note}" if r.note else ""))
    lines.append(f"parameters: {report.params_before:,} -> {report.params_after:,} "
                 f"({report.reduction:.1f} % fewer, {report.params_fraction:.3f} kept)")
    lines.append(f"weights: {report.bytes_before / 1e6:.2f} MB -> "
                 f"{report.bytes_after / 1e6:.2f} MB")
    return "\n".join(lines)


# --- measuring the trade-off --------------------------------------------------------------


def forward_tokens_per_second(
    model: nn.Module,
    *,
    batch_size: int = 8,
    context_length: int | None = None,
    repeats: int = 7,
    warmup: int = 2,
    device: torch.device | str | None = None,
) -> float:
    """Inference speed: tokens/s of a full forward pass over random ids (B, C).

    Median over ``repeats`` timed passes after ``warmup`` untimed ones, under
    ``torch.inference_mode``. C defaults to the model's context length.
    """
    param = next(model.parameters())
    device = torch.device(device) if device is not None else param.device
    C = context_length or model.config.context_length
    ids = torch.randint(0, model.config.vocab_size, (batch_size, C), device=device)  # (B, C)
    was_training = model.training
    model.eval()
    times = []
    with torch.inference_mode():
        for i in range(warmup + repeats):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model(ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    model.train(was_training)
    return batch_size * C / statistics.median(times)


@dataclass(frozen=True)
class SweepRow:
    """One point of a sweep: the fraction asked for, what was kept, loss and speed."""

    target: float
    params: int
    params_fraction: float
    loss: float
    tokens_per_s: float

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 700.0))


def sweep(
    model: nn.Module,
    fractions: Sequence[float],
    loss_fn: Callable[[nn.Module], float],
    *,
    layers: Sequence[str] = DEFAULT_LAYERS,
    rounds: int = 5,
    speed_kwargs: dict | None = None,
    progress: Callable[[SweepRow], None] | None = None,
) -> list[SweepRow]:
    """Compress a copy of ``model`` to each parameter fraction; measure loss and speed.

    The first row is the model itself (target 1.0, as given). ``loss_fn(model)`` returns
    the validation loss (e.g. ``evaluation.evaluate(m, val).loss``). Speed is
    :func:`forward_tokens_per_second` (3 timed passes, ``speed_kwargs`` override), taken
    in ``rounds`` interleaved rounds over all the models so that load changes on a shared
    machine hit every model alike; the row holds the median over rounds. ``model`` is not
    changed.
    """
    import copy

    for f in fractions:
        _check_fraction("params fraction", f)
    total = sum(p.numel() for p in model.parameters())
    models, losses = [], []
    for target in [1.0, *fractions]:
        m = model if not models else copy.deepcopy(model)
        if len(models) > 0:
            compress(m, params_fraction=target, layers=layers)
        models.append(m)
        losses.append(float(loss_fn(m)))
    kwargs = {"repeats": 3, "warmup": 1, **(speed_kwargs or {})}
    speeds: list[list[float]] = [[] for _ in models]
    for _ in range(rounds):
        for i, m in enumerate(models):
            speeds[i].append(forward_tokens_per_second(m, **kwargs))
    rows = []
    for target, m, loss, speed in zip([1.0, *fractions], models, losses, speeds, strict=True):
        params = sum(p.numel() for p in m.parameters())
        rows.append(SweepRow(target, params, params / total, loss, statistics.median(speed)))
        if progress is not None:
            progress(rows[-1])
    return rows


def format_sweep(rows: Sequence[SweepRow]) -> str:
    """The sweep as a Markdown table (also readable on a terminal)."""
    base = rows[0]
    lines = ["| target | params kept | params | val loss | perplexity | tokens/s | speed |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        target = "original" if r is base else f"{r.target:g}"
        lines.append(f"| {target} | {r.params_fraction:.3f} | {r.params:,} | {r.loss:.4f} | "
                     f"{r.perplexity:.3f} | {r.tokens_per_s:,.0f} | "
                     f"{r.tokens_per_s / base.tokens_per_s:.2f}x |")
    return "\n".join(lines)


def plot_sweep(rows: Sequence[SweepRow], path: str | Path, title: str | None = None) -> Path:
    """Validation loss vs share of parameters kept, speed on a second axis; written in
    the format of ``path``'s suffix (:func:`tinylm.use.plotting.save_figure`), returns the
    file really written."""
    figure_path(path)
    rows = sorted(rows, key=lambda r: r.params_fraction)
    x = [r.params_fraction for r in rows]
    fig = new_figure(6.4, 4.2, dpi=120)
    ax = fig.add_subplot(1, 1, 1)
    ax.plot(x, [r.loss for r in rows], "o-", color="C0", label="validation loss")
    ax.set_xlabel("share of parameters kept")
    ax.set_ylabel("validation loss (nats/token)", color="C0")
    ax.invert_xaxis()
    ax.grid(alpha=0.3)
    ax2 = ax.twinx()
    ax2.plot(x, [r.tokens_per_s for r in rows], "s--", color="C1", label="forward tokens/s")
    ax2.set_ylabel("forward pass tokens/s", color="C1")
    ax.set_title(title or "tinylm compress: loss and speed vs parameters kept")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, path)
