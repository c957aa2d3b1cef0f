"""Low-rank factorisation (SEED-MATH.md section 2): W ≈ W1·W2, and compress(model)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
from torch import nn

from tinylm import GPT, ConfigError, ModelConfig
from tinylm.commands.compress import compress, format_report
from tinylm.io.checkpoint import load_checkpoint
from tinylm.io.checkpoint_files import save_checkpoint
from tinylm.layers.lowrank import (
    LayerSpectrum,
    LowRankLinear,
    apply_structure,
    energy_rank,
    factorize,
    lowrank_params,
    max_saving_rank,
    rank_for_energy,
    ranks_for_budget,
    structure_of,
    truncation_error,
)


def matrix_with_singular_values(sigma: list[float], E: int, F: int) -> torch.Tensor:
    """A random (E, F) matrix whose singular values are exactly ``sigma`` (padded by 0)."""
    g = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(E, E, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(F, F, generator=g, dtype=torch.float64))
    S = torch.zeros(E, F, dtype=torch.float64)
    for i, s in enumerate(sigma):
        S[i, i] = s
    return U @ S @ V.T  # (E, E)·(E, F)·(F, F) -> (E, F)


def tiny(**kw) -> GPT:
    cfg = dict(vocab_size=40, context_length=16, n_layer=2, n_head=2, n_embd=32)
    cfg.update(kw)
    return GPT(ModelConfig(**cfg)).eval()


# --- one matrix ---------------------------------------------------------------------------


def test_full_rank_reproduces_W() -> None:
    W = torch.randn(24, 40)
    W1, W2 = factorize(W, 24)
    assert W1.shape == (24, 24) and W2.shape == (24, 40)
    torch.testing.assert_close(W1 @ W2, W, atol=1e-5, rtol=1e-5)


def test_rank_r_error_is_the_discarded_singular_values_eckart_young() -> None:
    sigma = [10.0, 7.0, 5.0, 3.0, 2.0, 1.0, 0.5, 0.25]
    W = matrix_with_singular_values(sigma, 8, 12)
    for r in range(1, 8):
        W1, W2 = factorize(W, r)
        err = torch.linalg.matrix_norm(W - W1 @ W2).item()
        assert err == pytest.approx(math.sqrt(sum(s * s for s in sigma[r:])), rel=1e-9)
        rel = truncation_error(torch.tensor(sigma), r)
        assert rel == pytest.approx(err / torch.linalg.matrix_norm(W).item(), rel=1e-9)
        # No random rank-r pair does better (least-squares W2 for a random W1 included).
        for _ in range(5):
            A = torch.randn(8, r, dtype=torch.float64)
            B = torch.linalg.lstsq(A, W).solution  # best W2 given this W1
            assert torch.linalg.matrix_norm(W - A @ B).item() >= err - 1e-9


def test_sqrt_sigma_is_split_evenly_between_the_factors() -> None:
    W = matrix_with_singular_values([9.0, 4.0, 1.0], 5, 7)
    W1, W2 = factorize(W, 2)
    # Columns of W1 and rows of W2 both have norm √σ_i.
    torch.testing.assert_close(W1.norm(dim=0), torch.tensor([3.0, 2.0], dtype=W.dtype))
    torch.testing.assert_close(W2.norm(dim=1), torch.tensor([3.0, 2.0], dtype=W.dtype))


def test_parameter_counts_closed_form_and_the_seeds_example() -> None:
    # The seed: E = 100, r = 10 -> 10,000 weights become 2,000, 80 % fewer.
    assert 100 * 100 == 10_000  # (the note's "1,000,000" is a slip)
    assert lowrank_params(100, 100, 10) == 2 * 100 * 10 == 2_000
    assert 1 - lowrank_params(100, 100, 10) / (100 * 100) == pytest.approx(0.80)
    layer = LowRankLinear.from_linear(nn.Linear(100, 100), 10)
    assert sum(p.numel() for p in layer.parameters()) == 2 * 100 * 10 + 100  # + bias
    no_bias = LowRankLinear.from_linear(nn.Linear(64, 256, bias=False), 8)
    assert sum(p.numel() for p in no_bias.parameters()) == lowrank_params(64, 256, 8)
    # Saving needs r·(E + F) < E·F: r < 50 for 100x100, r < 51.2 for 64 -> 256.
    assert max_saving_rank(100, 100) == 49 and max_saving_rank(64, 256) == 51


def test_lowrank_linear_equals_x_W1_W2_plus_b() -> None:
    dense = nn.Linear(16, 24)
    layer = LowRankLinear.from_linear(dense, 16)  # full rank: the same map
    x = torch.randn(3, 5, 16)
    torch.testing.assert_close(layer(x), dense(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layer(x), x @ layer.W1 @ layer.W2 + layer.bias)
    torch.testing.assert_close(layer.weight, dense.weight, atol=1e-5, rtol=1e-5)


def test_energy_rank_on_known_singular_values() -> None:
    sigma = torch.tensor([4.0, 2.0, 1.0, 1.0])  # σ² = 16, 4, 1, 1; total 22
    assert energy_rank(sigma, 16 / 22) == 1
    assert energy_rank(sigma, 0.73) == 2  # 16/22 = 0.727 < 0.73 <= 20/22
    assert energy_rank(sigma, 20 / 22) == 2
    assert energy_rank(sigma, 0.95) == 3  # 21/22 = 0.955
    assert energy_rank(sigma, 1.0) == 4
    W = matrix_with_singular_values([4.0, 2.0, 1.0, 1.0], 6, 9)
    assert rank_for_energy(W, 0.9) == 2 and rank_for_energy(W, 1.0) == 4
    for bad in (0, 0.0, -0.1, 1.5, True):
        with pytest.raises(ConfigError, match=r"\(0, 1\]"):
            energy_rank(sigma, bad)


def test_budget_ranks_follow_relative_energy_per_parameter() -> None:
    # Two 10 -> 10 layers (cost 20 per rank) and one 10 -> 30 layer (cost 40 per rank).
    a = LayerSpectrum("a", 10, 10, 100, torch.tensor([3.0, 2.0, 1.0, 0.5] + [0.0] * 6))
    b = LayerSpectrum("b", 10, 10, 100, torch.tensor([3.0, 0.1, 0.1] + [0.0] * 7))
    c = LayerSpectrum("c", 10, 30, 300, torch.tensor([2.0, 2.0, 2.0, 2.0] + [0.0] * 6))
    # Relative energies: a 9,4,1,.25 /14.25; b 9,.01,.01 /9.02; c 4 each /16.
    # Per parameter: a 4/14.25/20 = .0140, 1/14.25/20 = .0035; c .25/40 = .00625; b tiny.
    # Rank 1 everywhere costs 80; then a's σ2 (+20), c's σ2, σ3, σ4 (+40 each), a's σ3.
    assert ranks_for_budget([a, b, c], 80) == [1, 1, 1]
    assert ranks_for_budget([a, b, c], 100) == [2, 1, 1]
    assert ranks_for_budget([a, b, c], 140) == [2, 1, 2]
    assert ranks_for_budget([a, b, c], 199) == [2, 1, 3]
    assert ranks_for_budget([a, b, c], 219) == [3, 1, 3]  # c's σ4 (+40) does not fit, a's σ3 does
    assert ranks_for_budget([a, b, c], 220) == [2, 1, 4]
    with pytest.raises(ConfigError, match="budget cannot be met"):
        ranks_for_budget([a, b, c], 79)
    assert ranks_for_budget([a, b, c], 500) == [None, None, None]  # all fit as they are


def test_budget_leaves_a_layer_as_is_when_its_rank_would_not_save() -> None:
    # a is a 4 -> 4 layer (16 weights, saving needs r < 2); rank 2 would cost 16: keep it.
    a = LayerSpectrum("a", 4, 4, 16, torch.tensor([1.0, 1.0, 1.0, 1.0]))
    b = LayerSpectrum("b", 10, 10, 100, torch.tensor([1.0] + [0.001] * 9))
    assert ranks_for_budget([a, b], 16 + 20) == [None, 1]
    assert ranks_for_budget([a, b], 8 + 20) == [1, 1]


# --- a whole model ------------------------------------------------------------------------


def test_compress_fixed_rank_counts_and_skips() -> None:
    model = tiny()  # E = 32: qkv 32->96, out 32->32, up 32->128, down 128->32
    before = model.num_parameters()
    report = compress(model, rank=8)
    assert report.params_before == before and report.params_after == model.num_parameters()
    for row in report.layers:
        assert row.rank == 8 and row.params_after == 8 * (row.in_features + row.out_features) \
            + row.out_features
    assert structure_of(model) == {r.name: 8 for r in report.layers}
    assert before - report.params_after == sum(r.params_before - r.params_after
                                               for r in report.layers)
    # attn.out is 32 -> 32, so rank 16 costs 16·64 = 1024 = 32·32 weights: not a saving.
    report = compress(tiny(), rank=16)
    kept = {r.name for r in report.layers if not r.factorised}
    assert kept == {"blocks.0.attn.out", "blocks.1.attn.out"}
    assert all("would not save" in r.note for r in report.layers if not r.factorised)
    assert "rank" in format_report(report) and "fewer" in format_report(report)


def test_compress_keeps_logits_at_full_rank_and_errors_match() -> None:
    model = tiny()
    ids = torch.randint(0, 40, (2, 16))
    reference = model(ids)
    full = copy.deepcopy(model)
    compress(full, rank=32, layers=["attn.qkv", "ffn.up"])  # full rank: same map
    torch.testing.assert_close(full(ids), reference, atol=1e-4, rtol=1e-4)
    report = compress(model, energy=0.5)
    assert all(r.rel_error <= math.sqrt(0.5) + 1e-9 for r in report.layers if r.factorised)


def test_compress_params_fraction_meets_the_budget() -> None:
    model = tiny()
    report = compress(model, params_fraction=0.6)
    assert report.params_after <= 0.6 * report.params_before
    # Greedy fills the budget to within one rank of the most expensive layer.
    assert report.params_after > 0.6 * report.params_before - (32 + 128)
    with pytest.raises(ConfigError, match="cannot be reached"):
        compress(tiny(), params_fraction=0.05)


def test_compress_again_lowers_ranks_of_a_compressed_model() -> None:
    model = tiny()
    compress(model, rank=8)
    report = compress(model, rank=4, layers=["ffn.up"])
    assert structure_of(model)["blocks.0.ffn.up"] == 4
    assert structure_of(model)["blocks.0.attn.qkv"] == 8
    assert all(r.rank == 4 for r in report.layers)


def test_compressed_checkpoint_round_trips_with_identical_logits(tmp_path) -> None:
    model = tiny()
    compress(model, params_fraction=0.7)
    save_checkpoint(tmp_path / "ck", model)
    cfg = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert cfg["lowrank"] == structure_of(model) and cfg["lowrank"]
    loaded, _tok = load_checkpoint(tmp_path / "ck")
    assert structure_of(loaded) == structure_of(model)
    ids = torch.randint(0, 40, (2, 16))
    assert torch.equal(model(ids), loaded(ids))
    plain = tiny()
    save_checkpoint(tmp_path / "plain", plain)
    assert "lowrank" not in json.loads((tmp_path / "plain" / "config.json").read_text())


def test_apply_structure_builds_the_named_layers() -> None:
    model = apply_structure(tiny(), {"blocks.1.ffn.down": 5})
    layer = model.blocks[1].ffn.down
    assert isinstance(layer, LowRankLinear) and layer.W1.shape == (128, 5)
    assert layer.W2.shape == (5, 32) and structure_of(model) == {"blocks.1.ffn.down": 5}


@pytest.mark.parametrize("kwargs, match", [
    ({"rank": 0}, "rank must be an integer >= 1"),
    ({"rank": 33}, "above the full rank 32"),
    ({"energy": 0.0}, r"\(0, 1\]"),
    ({"energy": 1.2}, r"\(0, 1\]"),
    ({"params_fraction": 0.0}, r"\(0, 1\]"),
    ({"params_fraction": 1.01}, r"\(0, 1\]"),
    ({"rank": 4, "layers": ["attn.nope"]}, "unknown layer name 'attn.nope'"),
    ({}, "exactly one"),
    ({"rank": 4, "energy": 0.5}, "exactly one"),
])
def test_bad_arguments_raise_config_errors(kwargs, match) -> None:
    model = tiny()
    ids = torch.randint(0, 40, (1, 8))
    reference = model(ids)
    with pytest.raises(ConfigError, match=match) as info:
        compress(model, **kwargs)
    assert "\n" not in str(info.value)
    assert structure_of(model) == {} and torch.equal(model(ids), reference)  # untouched


def test_lowrank_depends_only_on_torch_and_the_core() -> None:
    import ast
    from pathlib import Path

    import tinylm.layers.lowrank

    tree = ast.parse(Path(tinylm.layers.lowrank.__file__).read_text(encoding="utf-8"))
    ours = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
            and n.module and n.module.startswith("tinylm")}
    # the layers room: the core, the shared dense-layer builder and the default layer
    # names (constants) only (the plot and the reports are tinylm.commands.compress's)
    assert ours <= {"tinylm.core.checks", "tinylm.core.errors", "tinylm.layers.dense",
                    "tinylm.layers.defaults"}, ours


def test_sweep_leaves_out_fractions_the_model_cannot_reach(caplog) -> None:
    """A small model's embeddings alone can hold more than a default sweep fraction: the
    sweep names what it leaves out and measures the rest (it used to fail whole)."""
    from tinylm.commands.compress import smallest_fraction, sweep

    model = GPT(ModelConfig(vocab_size=1024, context_length=16, n_layer=1, n_head=2, n_embd=32))
    floor = smallest_fraction(model)
    assert 0.5 < floor < 1  # the embeddings are 1024·32 of its ~46 K parameters
    rows = sweep(model, [0.95, floor / 2], lambda m: 0.0, rounds=1,
                 speed_kwargs={"batch_size": 1, "repeats": 1, "warmup": 0})
    assert [r.target for r in rows] == [1.0, 0.95]
    assert f"left out {floor / 2:g}" in caplog.text
    with pytest.raises(ConfigError, match="no sweep fraction can be reached"):
        sweep(model, [floor / 2], lambda m: 0.0)
