"""The Transformer language model (docs/attention.md, section 5).

    ids (B, C) --Embed--> (B, C, E) --N × Block--> (B, C, E) --Linear--> logits (B, C, V)

Embed is a table lookup: token id 42 -> row 42 of the (V, E) matrix (mathematically the
one-hot vector times that matrix), plus a learned positional embedding. Each Block is
Attention + FFN with pre-norm residual connections, as in GPT-2; the shape (B, C, E) is
kept, so blocks stack. The final Linear gives scores over the vocabulary; softmax of row
t is the distribution of the token *after* position t given tokens 0..t, so training
uses the cross-entropy of row t against token t+1.

This is the reference model: plain modules, math only. The fast paths of
:mod:`tinylm.native` are applied to it from outside (``tinylm.native.accelerate``) and
are proven equal to it in tests/test_equivalence.py.

The architecture options of :class:`~tinylm.core.config.ModelConfig` (docs/architectures.md)
swap parts in place: RMSNorm for LayerNorm, RoPE (inside attention) for the learned
position table, a SwiGLU or squared-ReLU MLP, grouped-query attention, QK-norm. Each is
written once, here and in attention.py.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.attention import MultiHeadAttention, RMSNorm
from tinylm.core.config import ModelConfig
from tinylm.core.errors import ConfigError

if TYPE_CHECKING:  # the cache is the decoder's object, handed in; only its type is named
    from tinylm.core.decoding import KVCache


def _dropout(drop: nn.Dropout, x: Tensor) -> Tensor:
    """``drop(x)``, skipping the module call where it is the identity (p = 0 or eval):
    a training step at small sizes is bound by per-call overhead."""
    return drop(x) if drop.training and drop.p > 0 else x


def _layer_norm(config: ModelConfig) -> nn.Module:
    """The block's normalisation: LayerNorm (GPT-2) or RMSNorm (``config.norm``)."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


class ReLUSquared(nn.Module):
    """max(0, x)², the activation of modded-nanogpt and nanochat."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


class FeedForward(nn.Module):
    """Position-wise FFN: E -> F -> activation -> E, F = ``config.ffn_dim`` (4·E by
    default); GELU (tanh approximation, as GPT-2) or squared ReLU (``mlp="relu2"``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.act = ReLUSquared() if config.mlp == "relu2" else nn.GELU(approximate="tanh")
        self.down = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        y = self.down(self.act(self.up(x)))  # (B, C, E) -> (B, C, F) -> (B, C, E)
        return _dropout(self.drop, y)


class GatedFeedForward(nn.Module):
    """SwiGLU (Shazeer 2020, as in Llama): down(SiLU(gate(x)) ⊙ up(x)), E -> F -> E.

    The gate's SiLU decides, per hidden unit, how much of the linear ``up`` passes."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.up = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.down = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        h = F.silu(self.gate(x)) * self.up(x)  # (B, C, E) -> (B, C, F)
        return _dropout(self.drop, self.down(h))  # -> (B, C, E)


def feed_forward(config: ModelConfig) -> nn.Module:
    """The MLP ``config.mlp`` names."""
    return GatedFeedForward(config) if config.mlp == "swiglu" else FeedForward(config)


class Block(nn.Module):
    """One Transformer block: x + Attention(Norm(x)), then x + FFN(Norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.ln1 = _layer_norm(config)
        self.attn = MultiHeadAttention(
            config.n_embd, config.n_head, config.head_dim, bias=config.bias,
            dropout=config.dropout, n_kv_head=config.n_kv_head, qkv_bias=config.qkv_bias,
            rope_theta=config.rope_theta if config.position == "rope" else None,
            qk_norm=config.qk_norm, norm_eps=config.norm_eps,
        )
        self.ln2 = _layer_norm(config)
        self.ffn = feed_forward(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        a = self.attn(self.ln1(x), cache, layer, return_weights=return_weights)
        a, weights = a if return_weights else (a, None)
        x = x + _dropout(self.drop, a)
        x = x + self.ffn(self.ln2(x))
        return (x, weights) if return_weights else x


class GPT(nn.Module):
    """Decoder-only Transformer LM: ``GPT(config)(ids)`` -> logits (B, C, V).

    The model has no side effects: no device or dtype baked in, no optimizer and no
    hidden cache; a :class:`KVCache` is passed to :meth:`forward` for decoding.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.n_embd)
        # RoPE (position="rope") rotates queries and keys instead: no position table.
        self.pos_emb = (nn.Embedding(config.context_length, config.n_embd)
                        if config.position == "learned" else None)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.final_norm = _layer_norm(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        self.reset_parameters()

    # -- init ----------------------------------------------------------------------------

    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, residual projections scaled by
        1/√(2·n_layer) so the residual stream's variance does not grow with depth."""
        std = 0.02
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=std)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
        scaled = std / math.sqrt(2 * self.config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.out.weight, mean=0.0, std=scaled)
            nn.init.normal_(block.ffn.down.weight, mean=0.0, std=scaled)

    # -- forward -------------------------------------------------------------------------

    def _embed(self, ids: Tensor, start: int, pos: Tensor | None = None) -> Tensor:
        """Token plus positional embeddings of ids (B, C) at positions [start, start + C),
        or at ``pos`` — (C,), or (B, C) where rows have their own positions (a
        :class:`~tinylm.core.decoding.RaggedKVCache`)."""
        B, C = ids.shape
        if start + C > self.config.context_length:
            raise ConfigError(
                f"sequence of {start + C} tokens is longer than the model's context_length "
                f"{self.config.context_length}; shorten the input or slide a window"
            )
        x = self.tok_emb(ids)  # (B, C, E)
        if self.pos_emb is not None:  # learned positions; RoPE acts inside attention
            if pos is None:
                pos = torch.arange(start, start + C, device=ids.device)  # (C,)
            x = x + self.pos_emb(pos)  # + (C, E) or (B, C, E)
        return _dropout(self.drop, x)

    def hidden_states(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """ids (B, C) -> final-normed hidden states (B, C, E). With a cache, the tokens'
        positions are the cache's next ones (``cache.positions``)."""
        start = cache.length if cache is not None else 0
        pos = cache.positions(ids.shape[1], ids.device) if cache is not None else None
        x = self._embed(ids, start, pos)
        for i, block in enumerate(self.blocks):
            x = block(x, cache, i)
        if cache is not None:
            cache.advance(ids.shape[1])
        return self.final_norm(x)

    def forward(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """ids (B, C) int64 -> logits (B, C, V). Row t scores the token after position t.

        With a cache, ``ids`` are the next C tokens after the cached ones; their
        positions continue from ``cache.length``.
        """
        return self.lm_head(self.hidden_states(ids, cache))  # (B, C, E) -> (B, C, V)

    def forward_with_attention(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Logits (B, C, V) and every attention map (L, B, H, C, C), via the explicit path."""
        x = self._embed(ids, 0)
        maps = []
        for block in self.blocks:
            x, w = block(x, return_weights=True)
            maps.append(w)  # (B, H, C, C)
        return self.lm_head(self.final_norm(x)), torch.stack(maps)  # maps -> (L, B, H, C, C)

    def probabilities(self, ids: Tensor) -> Tensor:
        """Softmax of the logits: one next-token distribution per position, (B, C, V)."""
        return F.softmax(self(ids), dim=-1)

    def loss(self, ids: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy of row t against targets[:, t] (usually ids shifted by one)."""
        return lm_loss(self(ids), targets)

    # -- sizes ---------------------------------------------------------------------------

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied LM head counts once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_emb.weight.numel()
            n -= self.pos_emb.weight.numel() if self.pos_emb is not None else 0
        return n


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Cross-entropy of logits (B, C, V) against targets (B, C), averaged over tokens."""
    V = logits.shape[-1]
    return F.cross_entropy(logits.reshape(-1, V).float(), targets.reshape(-1),
                           ignore_index=ignore_index)  # (B·C, V) vs (B·C,)


def parameter_count(config: ModelConfig) -> int:
    """Closed-form number of parameters of ``GPT(config)``.

    Per block: QKV E·(H + 2·H_kv)·D (+ that many QKV biases), output H·D·E (+E), the
    MLP's 2 (gelu, relu2) or 3 (swiglu) matrices of E·F (+F per input-side matrix, +E),
    two norms of E (+E bias each for a biased LayerNorm), QK-norm 2·D. Plus the token
    embedding V·E, a learned position table C·E, the final norm, and an untied head V·E.
    """
    E, HD, F4, V = config.n_embd, config.inner_dim, config.ffn_dim, config.vocab_size
    b = 1 if config.bias else 0
    qkv = E * (HD + 2 * config.kv_dim) + (HD + 2 * config.kv_dim) * config.qkv_bias
    mats = 3 if config.mlp == "swiglu" else 2
    norm = E + (E * b if config.norm == "layernorm" else 0)
    block = qkv + HD * E + b * E + mats * E * F4 + b * ((mats - 1) * F4 + E) + 2 * norm
    block += 2 * config.head_dim * config.qk_norm
    total = config.n_layer * block + V * E + norm
    if config.position == "learned":
        total += config.context_length * E
    if not config.tie_embeddings:
        total += V * E
    return total
