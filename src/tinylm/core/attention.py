"""Attention, step by step, in the seed's letters.

Shape legend (used in every comment below):

    B  batch size
    C  context length (number of query positions in this call)
    T  number of key/value positions (C, or cache length + C when decoding)
    E  embedding dim (width of the residual stream)
    H  number of heads
    D  query/key/value dim per head
    V  vocabulary size (only in model.py)

The seed's single-head attention (docs/attention.md, section 1):

    Q = x·W_q (C, D)     K = x·W_k (C, D)     V = x·W_v (C, E)
    S = Q·Kᵀ / √D (C, C)                     -- step 1, scaled similarity
    A = softmax(mask(S)) (C, C)              -- step 2, the attention map
    out = A·V (C, E)                         -- step 3

Multi-head attention (docs/attention.md, sections 3-4) gives each head its own W_q^i,
W_k^i, W_v^i (E, D) and W_o^i (D, E). Two equal ways to combine the heads:

    sum form      MultiHead(x) = Σ_i A^i · V^i · W_o^i
    concat form   MultiHead(x) = [R^1 … R^H] (C, H·D) · [W_o^1; …; W_o^H] (H·D, E)

The concat form is what :class:`MultiHeadAttention` computes, with all heads' Q, K, V
from one fused (E, 3·H·D) projection, by two paths proven equal in the tests: the
explicit one (which can return the attention map) and the fused one through
``torch.nn.functional.scaled_dot_product_attention``. This file is the reference: the
fast paths of :mod:`tinylm.native` are applied from outside and proven equal to it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:  # the cache is the decoder's object, handed in; only its type is named
    from tinylm.core.decoding import KVCache

# --- the math as small pure functions ---------------------------------------------------


def causal_mask(C: int, T: int | None = None, device: torch.device | str | None = None) -> Tensor:
    """Boolean (C, T) mask, True where query i may look at key j.

    Query i sits at absolute position ``T - C + i`` (the last C of T positions, as when
    C new tokens follow T - C cached ones), so it may see keys j <= T - C + i. With
    T == C this is the lower-triangular matrix of the seed (torch.tril of ones).
    """
    T = C if T is None else T
    if T < C:
        raise ValueError(f"causal_mask needs T >= C, got C={C}, T={T}")
    return torch.ones(C, T, dtype=torch.bool, device=device).tril(diagonal=T - C)


def attention_scores(q: Tensor, k: Tensor) -> Tensor:
    """Step 1: scaled similarity S = Q·Kᵀ/√D.

    q (..., C, D), k (..., T, D) -> (..., C, T). Dividing by √D keeps the variance of S
    near 1 for unit-variance inputs, so softmax does not saturate.
    """
    D = q.shape[-1]
    return torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(D)  # (..., C, D)·(..., D, T)


def attention_weights(scores: Tensor, mask: Tensor | None = None) -> Tensor:
    """Step 2: the attention map, softmax over keys of the masked scores.

    scores (..., C, T); mask (C, T) boolean, True = allowed. Masked entries are set to
    -inf so their weight is exactly 0; each row sums to 1.
    """
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return F.softmax(scores, dim=-1)


def explicit_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Steps 1-3 written out: returns (A·V, A).

    q (..., C, D), k (..., T, D), v (..., T, Dv) -> out (..., C, Dv), weights (..., C, T).
    """
    weights = attention_weights(attention_scores(q, k), mask)  # (..., C, T)
    return torch.matmul(weights, v), weights  # (..., C, T)·(..., T, Dv) -> (..., C, Dv)


# --- the variants' math: rotary positions, RMS norm, shared key/value heads -------------


def rope_angles(start: int, C: int, head_dim: int, theta: float,
                device: torch.device | str | None = None) -> tuple[Tensor, Tensor]:
    """cos and sin (C, D) of rotary positions start .. start + C - 1.

    Pair i of a head (dims i and i + D/2, Hugging Face's "rotate half" layout) turns
    by the angle m·ω_i at position m, with ω_i = θ^(-2i/D): fast pairs see local
    order, slow pairs far context. Both halves of a row repeat the C × D/2 angles.
    """
    return rope_angles_at(torch.arange(start, start + C, device=device), head_dim, theta)


def rope_angles_at(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin (..., D) of the rotary angles at any integer ``positions`` (...,),
    e.g. each row's own position in a batch: :func:`rope_angles` is the case
    ``positions = start .. start + C - 1``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                               dtype=torch.int64).float() / head_dim))
    angles = positions.float()[..., None] * inv_freq  # (..., D/2): m·ω_i
    angles = torch.cat((angles, angles), dim=-1)  # (..., D)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate every pair (x_i, x_{i+D/2}) of x (..., C, D) by its angle:
    (x_i cos − x_{i+D/2} sin, x_{i+D/2} cos + x_i sin). A rotation keeps ‖x‖, and
    R(m)q · R(n)k = q · R(n − m)k, so the scores of rotated queries and keys depend
    on positions only through m − n."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # (−x₂, x₁)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class RMSNorm(nn.Module):
    """x / RMS(x) · g, RMS(x) = √(mean(x²) + ε) over the last dim (no mean subtracted,
    no bias: LayerNorm's rescaling without its recentring, Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def repeat_kv(x: Tensor, n_rep: int) -> Tensor:
    """Grouped-query attention's sharing made explicit: (B, H_kv, T, D) ->
    (B, H_kv·n_rep, T, D), query head i reading key/value head i // n_rep."""
    return x if n_rep == 1 else x.repeat_interleave(n_rep, dim=1)


# --- the note's own class ---------------------------------------------------------------


class SingleHeadAttention(nn.Module):
    """The seed's ``Attention(embed_dim, key_dim)`` class, kept as written.

    W_q, W_k: E -> D and W_v: E -> E, no biases, causal mask, softmax. Input (B, C, E),
    output (B, C, E); with ``return_weights=True`` also the attention map (B, C, C).
    """

    def __init__(self, embed_dim: int, key_dim: int) -> None:
        super().__init__()
        self.W_q = nn.Linear(embed_dim, key_dim, bias=False)
        self.W_k = nn.Linear(embed_dim, key_dim, bias=False)
        self.W_v = nn.Linear(embed_dim, embed_dim, bias=False)
        self.key_dim = key_dim

    def forward(self, x: Tensor, return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        C = x.shape[1]
        q = self.W_q(x)  # (B, C, E) -> (B, C, D)
        k = self.W_k(x)  # (B, C, E) -> (B, C, D)
        v = self.W_v(x)  # (B, C, E) -> (B, C, E)
        out, weights = explicit_attention(q, k, v, causal_mask(C, device=x.device))
        return (out, weights) if return_weights else out


# --- multi-head attention ---------------------------------------------------------------


class MultiHeadAttention(nn.Module):
    """Causal multi-head attention with a fused QKV projection.

    ``qkv``: E -> (H + 2·H_kv)·D holds every head's W_q^i, then the key and value heads'
    W_k^j, W_v^j side by side (the output is laid out as [q | k | v]: H query heads of D,
    then H_kv key heads and H_kv value heads). With H_kv = H (the default) this is
    GPT-2's layout; with fewer, each key/value head serves H / H_kv query heads
    (grouped-query attention; H_kv = 1 is multi-query). ``out``: H·D -> E is the
    stacked [W_o^1; …; W_o^H]. Biases are optional (GPT-2 has them, the seed does not;
    ``qkv_bias`` sets the QKV projection's alone, as Qwen2 has). ``rope_theta`` rotates
    queries and keys by position (RoPE, :func:`apply_rope`); ``qk_norm`` RMS-normalises
    each head's query and key first.
    """

    def __init__(self, n_embd: int, n_head: int, head_dim: int, *, bias: bool = True,
                 dropout: float = 0.0, n_kv_head: int | None = None,
                 qkv_bias: bool | None = None, rope_theta: float | None = None,
                 qk_norm: bool = False, norm_eps: float = 1e-5) -> None:
        super().__init__()
        self.n_head = n_head
        self.n_kv_head = n_head if n_kv_head is None else n_kv_head
        self.head_dim = head_dim
        width = (n_head + 2 * self.n_kv_head) * head_dim
        self.qkv = nn.Linear(n_embd, width, bias=bias if qkv_bias is None else qkv_bias)
        self.out = nn.Linear(n_head * head_dim, n_embd, bias=bias)
        self.dropout = dropout
        self.rope_theta = rope_theta
        self.q_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps) if qk_norm else None

    def _heads(self, x: Tensor, positions: Tensor | None = None
                ) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, C, D), k and v (B, H_kv, C, D) of x (B, C, E) at ``positions`` ((C,),
        or (B, C) when rows have their own, as in a RaggedKVCache; default 0..C-1),
        QK-normed and rotated where the layout says so (keys are cached rotated)."""
        B, C, _ = x.shape
        H, Hkv, D = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)  # [q | k | v]
        q = q.view(B, C, H, D).transpose(1, 2)  # (B, C, H·D) -> (B, H, C, D)
        k = k.view(B, C, Hkv, D).transpose(1, 2)  # -> (B, H_kv, C, D)
        v = v.view(B, C, Hkv, D).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            pos = positions if positions is not None else torch.arange(C, device=x.device)
            cos, sin = rope_angles_at(pos, D, self.rope_theta)  # (C, D) or (B, C, D)
            if cos.dim() == 3:  # per row: broadcast over the heads
                cos, sin = cos[:, None], sin[:, None]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        return q, k, v

    def forward(
        self,
        x: Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
        *,
        return_weights: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """x (B, C, E) -> (B, C, E); with return_weights also the map (B, H, C, T).

        The fast path uses SDPA; ``return_weights=True`` takes the explicit path. With a
        cache, keys/values of earlier positions come from it and the new ones are written
        into it (the caller advances it after the last layer).
        """
        B, C, _ = x.shape
        rotate = cache is not None and self.rope_theta is not None
        positions = cache.positions(C, x.device) if rotate else None  # only RoPE needs them
        q, k, v = self._heads(x, positions)  # (B, H, C, D), 2 × (B, H_kv, C, D)
        gqa = self.n_kv_head != self.n_head
        if cache is not None and cache.attends(C) and not return_weights \
                and not (self.training and self.dropout > 0):
            # the cache attends: one decoding step (C = 1), or C tokens per row of a cache
            # whose rows have their own lengths (RaggedKVCache); -> (B, H, C, D)
            r = cache.attend(layer, q, k, v)
            return self.out(r.transpose(1, 2).reshape(B, C, self.n_head * self.head_dim))
        if cache is not None:
            k, v = cache.update(layer, k, v)  # -> (B, H_kv, T, D), T = cached + C
        T = k.shape[2]
        if return_weights:
            n_rep = self.n_head // self.n_kv_head  # query heads per key/value head
            r, weights = explicit_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep),
                                            causal_mask(C, T, device=x.device))
        else:
            weights = None
            p = self.dropout if self.training else 0.0
            if T == C:  # no cache offset: the standard causal mask
                r = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True,
                                                   enable_gqa=gqa)
            elif C == 1:  # one new token sees every cached key
                r = F.scaled_dot_product_attention(q, k, v, dropout_p=p, enable_gqa=gqa)
            else:  # C new tokens after T - C cached ones
                mask = causal_mask(C, T, device=x.device)
                r = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p,
                                                   enable_gqa=gqa)
        r = r.transpose(1, 2).reshape(B, C, self.n_head * self.head_dim)  # (B,H,C,D)->(B,C,H·D)
        y = self.out(r)  # [R^1 … R^H]·[W_o^1; …; W_o^H]: (B, C, H·D) -> (B, C, E)
        return (y, weights) if return_weights else y

    def forward_sum_form(self, x: Tensor) -> Tensor:
        """The seed's sum form, head by head: Σ_i softmax(mask(Q^iK^iᵀ/√D))·V^i·W_o^i.

        Slow and explicit; exists to prove it equals the concat form of :meth:`forward`.
        """
        B, C, _ = x.shape
        q, k, v = self._heads(x)  # (B, H, C, D), 2 × (B, H_kv, C, D)
        mask = causal_mask(C, device=x.device)
        D, n_rep = self.head_dim, self.n_head // self.n_kv_head
        y = torch.zeros(B, C, self.out.out_features, dtype=x.dtype, device=x.device)
        for i in range(self.n_head):
            j = i // n_rep  # the key/value head query head i shares
            r_i, _ = explicit_attention(q[:, i], k[:, j], v[:, j], mask)  # (B, C, D)
            W_o_i = self.out.weight[:, i * D:(i + 1) * D].t()  # (D, E), rows of W_o for head i
            y = y + r_i @ W_o_i  # (B, C, D)·(D, E) -> (B, C, E)
        if self.out.bias is not None:
            y = y + self.out.bias
        return y
