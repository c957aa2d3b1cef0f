"""The seed's attention equations, each against an oracle."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tinylm.core.attention import (
    MultiHeadAttention,
    SingleHeadAttention,
    attention_scores,
    attention_weights,
    causal_mask,
    explicit_attention,
)
from tinylm.core.decoding import KVCache


def test_causal_mask_is_lower_triangular() -> None:
    m = causal_mask(4)
    assert m.dtype == torch.bool
    assert torch.equal(m, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    # With a cache: 2 new queries after 3 cached keys see positions up to 3 and 4.
    m = causal_mask(2, 5)
    assert m.tolist() == [[True, True, True, True, False], [True, True, True, True, True]]


def test_seed_example_shapes_and_attention_map() -> None:
    """The note's own example: E=256, D=64, x (2, 5, 256) -> (2, 5, 256)."""
    attn = SingleHeadAttention(embed_dim=256, key_dim=64)
    x = torch.randn(2, 5, 256)
    y, w = attn(x, return_weights=True)
    assert y.shape == (2, 5, 256)
    assert w.shape == (2, 5, 5)
    # Lower-triangular: no weight on the future, exactly zero.
    assert torch.all(w.triu(diagonal=1) == 0)
    # Rows are probability distributions.
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 5))
    assert torch.all(w >= 0)
    # Step 3: output = weights · V.
    torch.testing.assert_close(y, w @ attn.W_v(x))
    # Row 0 can only attend to itself.
    torch.testing.assert_close(w[:, 0, 0], torch.ones(2))


def test_single_head_matches_sdpa() -> None:
    attn = SingleHeadAttention(embed_dim=32, key_dim=8)
    x = torch.randn(3, 7, 32)
    ref = F.scaled_dot_product_attention(attn.W_q(x), attn.W_k(x), attn.W_v(x), is_causal=True)
    torch.testing.assert_close(attn(x), ref, atol=1e-6, rtol=1e-5)


def test_scaling_by_sqrt_d_brings_score_variance_near_one() -> None:
    """For unit-variance q, k, Var(q·k) = D; dividing by √D makes it ~1."""
    g = torch.Generator().manual_seed(1)
    D = 256
    q = torch.randn(64, 128, D, generator=g)
    k = torch.randn(64, 128, D, generator=g)
    raw = q @ k.transpose(-2, -1)
    scaled = attention_scores(q, k)
    assert abs(raw.var().item() / D - 1) < 0.05
    assert abs(scaled.var().item() - 1) < 0.05
    torch.testing.assert_close(scaled, raw / math.sqrt(D))


def test_unscaled_scores_saturate_softmax() -> None:
    """Without √D the softmax is near one-hot (saturated): its gradient almost vanishes."""
    g = torch.Generator().manual_seed(2)
    D = 512
    q, k = torch.randn(1, 16, D, generator=g), torch.randn(1, 16, D, generator=g)
    raw = F.softmax(q @ k.transpose(-2, -1), dim=-1)
    scaled = attention_weights(attention_scores(q, k))
    assert raw.max(-1).values.mean() > 0.9
    assert scaled.max(-1).values.mean() < 0.6


def test_masked_entries_get_exactly_zero_weight() -> None:
    scores = torch.randn(2, 6, 6) * 100
    w = attention_weights(scores, causal_mask(6))
    assert torch.all(w.triu(1) == 0)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 6))


@pytest.mark.parametrize("bias", [True, False])
def test_multihead_explicit_equals_sdpa_path(bias: bool) -> None:
    mha = MultiHeadAttention(n_embd=48, n_head=3, head_dim=16, bias=bias)
    x = torch.randn(2, 9, 48)
    fast = mha(x)
    slow, w = mha(x, return_weights=True)
    assert w.shape == (2, 3, 9, 9)
    torch.testing.assert_close(fast, slow, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 3, 9))
    assert torch.all(w.triu(1) == 0)


def test_multihead_sum_form_equals_concat_form() -> None:
    """Σ_i A^i·V^i·W_o^i == [R^1 … R^H]·[W_o^1; …; W_o^H] (SEED-MATH section 4)."""
    mha = MultiHeadAttention(n_embd=40, n_head=5, head_dim=8, bias=True)
    x = torch.randn(3, 6, 40)
    torch.testing.assert_close(mha.forward_sum_form(x), mha(x), atol=1e-6, rtol=1e-5)


def test_head_dim_independent_of_embedding() -> None:
    """H·D need not equal E: the output projection maps H·D back to E."""
    mha = MultiHeadAttention(n_embd=24, n_head=4, head_dim=10, bias=False)
    x = torch.randn(2, 5, 24)
    assert mha(x).shape == (2, 5, 24)
    torch.testing.assert_close(mha.forward_sum_form(x), mha(x), atol=1e-6, rtol=1e-5)


def test_multihead_matches_torch_multihead_attention() -> None:
    E, H, C = 32, 4, 7
    mha = MultiHeadAttention(n_embd=E, n_head=H, head_dim=E // H, bias=True)
    ref = torch.nn.MultiheadAttention(E, H, bias=True, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(mha.qkv.weight)  # both (3E, E), rows [q | k | v]
        ref.in_proj_bias.copy_(mha.qkv.bias)
        ref.out_proj.weight.copy_(mha.out.weight)
        ref.out_proj.bias.copy_(mha.out.bias)
    x = torch.randn(2, C, E)
    # torch's attn_mask: True = NOT allowed.
    expected, ref_w = ref(x, x, x, attn_mask=~causal_mask(C), average_attn_weights=False)
    ours, w = mha(x, return_weights=True)
    torch.testing.assert_close(ours, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(mha(x), expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("cls", ["single", "multi"])
def test_attention_is_causal(cls: str) -> None:
    """Changing token t+1 leaves every output up to t unchanged."""
    attn = SingleHeadAttention(16, 4) if cls == "single" else MultiHeadAttention(16, 4, 4)
    x = torch.randn(1, 8, 16)
    for t in range(7):
        x2 = x.clone()
        x2[:, t + 1:] = torch.randn_like(x2[:, t + 1:])
        y, y2 = attn(x), attn(x2)
        torch.testing.assert_close(y[:, : t + 1], y2[:, : t + 1], atol=0, rtol=0)
        assert not torch.allclose(y[:, t + 1:], y2[:, t + 1:])


def test_explicit_attention_matches_sdpa_with_offset_mask() -> None:
    q, k, v = torch.randn(2, 3, 3, 8), torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)
    mask = causal_mask(3, 7)
    out, w = explicit_attention(q, k, v, mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    assert torch.all(w[..., 0, 5:] == 0) and torch.all(w[..., 2, :] > 0)


def test_kv_cache_update_and_overflow() -> None:
    cache = KVCache(n_layer=2, batch_size=1, n_head=2, max_len=4, head_dim=3)
    k = torch.randn(1, 2, 3, 3)
    ks, vs = cache.update(0, k, k * 2)
    assert ks.shape == (1, 2, 3, 3)
    torch.testing.assert_close(vs, k * 2)
    cache.advance(3)
    assert cache.length == 3
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, torch.randn(1, 2, 2, 3), torch.randn(1, 2, 2, 3))
    cache.reset()
    assert cache.length == 0
