"""The Transformer language model (SEED-MATH.md section 5).

    ids (B, C) --Embed--> (B, C, E) --N × Block--> (B, C, E) --Linear--> logits (B, C, V)

Embed is a table lookup: token id 42 -> row 42 of the (V, E) matrix (mathematically the
one-hot vector times that matrix), plus a learned positional embedding. Each Block is
Attention + FFN with pre-norm residual connections, as in GPT-2; the shape (B, C, E) is
kept, so blocks stack. The final Linear gives scores over the vocabulary; softmax of row
t is the distribution of the token *after* position t given tokens 0..t, so training
uses the cross-entropy of row t against token t+1.

The architecture options of :class:`~tinylm.config.ModelConfig` (docs/architectures.md)
swap parts in place: RMSNorm for LayerNorm, RoPE (inside attention) for the learned
position table, a SwiGLU or squared-ReLU MLP, grouped-query attention, QK-norm. Each is
written once, here and in attention.py; the fused native training steps below run
only GPT-2's layout (``config.gpt2_layout``) and step aside for every other.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm import kernels
from tinylm.attention import (
    KVCache,
    MultiHeadAttention,
    RMSNorm,
    hooked,
    qkv_attention_backward,
)
from tinylm.config import ModelConfig
from tinylm.errors import ConfigError


def _dropout(drop: nn.Dropout, x: Tensor) -> Tensor:
    """``drop(x)``, skipping the module call where it is the identity (p = 0 or eval):
    a training step at small sizes is bound by per-call overhead."""
    return drop(x) if drop.training and drop.p > 0 else x


def _layer_norm(config: ModelConfig) -> nn.Module:
    """The block's normalisation: LayerNorm (GPT-2) or RMSNorm (``config.norm``)."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.n_embd, eps=config.norm_eps)
    return nn.LayerNorm(config.n_embd, eps=config.norm_eps, bias=config.bias)


def _ffn_backward(gy: Tensor, x2: Tensor, h: Tensor, w_up: Tensor, w_down: Tensor,
                  need: tuple[bool, bool, bool, bool]) -> tuple[Tensor | None, ...]:
    """Backward of y = GELU(h)·W_downᵀ (+ b_down), h = x2·W_upᵀ + b_up, from dL/dy
    (B·C, E) and the kept x2, h: the gradients of (x2, W_up, b_up, W_down) — each only
    where ``need`` says so. GELU(h) is recomputed; b_up's gradient is summed in the
    same native pass (b_down's is dL/dy summed over rows, left to the caller)."""
    grad_g = gy @ w_down  # (B·C, E)·(E, 4E) -> (B·C, 4E)
    grad_h, g, grad_b_up = kernels.gelu_backward(grad_g, h, sum_rows=need[2])
    grad_w_down = gy.t() @ g if need[3] else None  # (E, B·C)·(B·C, 4E) -> (E, 4E)
    grad_w_up = grad_h.t() @ x2 if need[1] else None  # (4E, B·C)·(B·C, E) -> (4E, E)
    grad_x2 = grad_h @ w_up if need[0] else None  # (B·C, 4E)·(4E, E) -> (B·C, E)
    return grad_x2, grad_w_up, grad_b_up, grad_w_down


class _FeedForwardFn(torch.autograd.Function):
    """The FFN for training, y = GELU_tanh(x·W_upᵀ + b_up)·W_downᵀ + b_down, as one
    autograd step that keeps only x and h = x·W_upᵀ + b_up for backward.

    Plain autograd would also keep GELU(h), (B, C, 4E) — with h the largest activations
    of a block. GELU is cheap, so backward recomputes it from h instead: the same values
    and gradients, 4E fewer floats per token per layer. On CPU the bias add and GELU
    run as one native pass (:func:`tinylm.kernels.bias_gelu_`), and backward's GELU
    gradient and recomputation as another, where torch's tanh-GELU is slow.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
                b_down: Tensor | None) -> Tensor:
        x2 = x.reshape(-1, x.shape[-1])  # (B, C, E) -> (B·C, E)
        h = x2 @ w_up.t()  # (B·C, E)·(E, 4E) -> (B·C, 4E)
        g = kernels.bias_gelu_(h, b_up)  # h += b_up in place; g = GELU(h)
        y = g @ w_down.t()  # (B·C, 4E)·(4E, E) -> (B·C, E)
        if b_down is not None:
            y += b_down
        ctx.save_for_backward(x2, h, w_up, w_down)
        ctx.biases = (b_up is not None, b_down is not None)
        return y.view(*x.shape[:-1], y.shape[-1])  # -> (B, C, E)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        x2, h, w_up, w_down = ctx.saved_tensors
        # Under autocast h is bf16 while x and the weights stay fp32; backward runs
        # outside autocast, so compute in h's dtype (no-ops in fp32). Autograd casts
        # each returned gradient back to its input's dtype.
        dt = h.dtype
        x2, w_up, w_down = x2.to(dt), w_up.to(dt), w_down.to(dt)
        gy = grad_y.to(dt).reshape(-1, grad_y.shape[-1])  # (B, C, E) -> (B·C, E)
        need = ctx.needs_input_grad
        grad_x2, grad_w_up, grad_b_up, grad_w_down = _ffn_backward(
            gy, x2, h, w_up, w_down, (need[0], need[1], ctx.biases[0] and need[2], need[3]))
        grad_b_down = gy.sum(0) if ctx.biases[1] and need[4] else None  # (E,)
        grad_x = grad_x2.view(grad_y.shape[:-1] + (w_up.shape[1],)) if need[0] else None
        return grad_x, grad_w_up, grad_b_up, grad_w_down, grad_b_down


class ReLUSquared(nn.Module):
    """max(0, x)², the activation of modded-nanogpt and nanochat."""

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(x).square()


class FeedForward(nn.Module):
    """Position-wise FFN: E -> F -> activation -> E, F = ``config.ffn_dim`` (4·E by
    default); GELU (tanh approximation, as GPT-2) or squared ReLU (``mlp="relu2"``).

    When gradients are recorded, a GELU FFN runs as one autograd step that recomputes
    GELU in backward (:class:`_FeedForwardFn`) to halve the FFN's saved activations.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.n_embd, config.ffn_dim, bias=config.bias)
        self.act = ReLUSquared() if config.mlp == "relu2" else nn.GELU(approximate="tanh")
        self.down = nn.Linear(config.ffn_dim, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        if torch.is_grad_enabled() and type(self.act) is nn.GELU \
                and type(self.up) is nn.Linear and type(self.down) is nn.Linear \
                and not hooked(self.up, self.down):
            y = _FeedForwardFn.apply(x, self.up.weight, self.up.bias, self.down.weight,
                                     self.down.bias)  # (B, C, E) -> (B, C, E)
        else:  # inference, hooked or replaced layers (e.g. tinylm.lowrank's LowRankLinear)
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


class _BlockFn(torch.autograd.Function):
    """A whole block for CPU training as one autograd step, with native kernels:

        x1 = x + Attention(LN1(x))          y = x1 + FFN(LN2(x1))

    The same tensors are kept for backward as the block's separate steps would keep
    (LN inputs, LN outputs, qkv, the heads' outputs, the FFN's pre-activation), but
    LayerNorm runs natively (:func:`tinylm.kernels.layer_norm`), each residual add is
    done by the output projection's product itself (beta = 1), and in backward the
    residual gradient is added in place — where a graph of a dozen small autograd
    steps per block (LN, projections, adds, gradient accumulation) costs more than
    their arithmetic at small sizes. Used by :class:`Block` only where its parts are
    plain modules that nobody hooks (see ``Block._fusable``).
    """

    @staticmethod
    def forward(ctx, x: Tensor, n_head: int, eps1: float, eps2: float,
                ln1_w: Tensor | None, ln1_b: Tensor | None, w_qkv: Tensor,
                b_qkv: Tensor | None, w_out: Tensor, b_out: Tensor | None,
                ln2_w: Tensor | None, ln2_b: Tensor | None, w_up: Tensor,
                b_up: Tensor | None, w_down: Tensor, b_down: Tensor | None) -> Tensor:
        B, C, E = x.shape
        x0 = x.contiguous().view(-1, E)  # (B·C, E)
        a_in, mu1, rs1 = kernels.layer_norm(x0, ln1_w, ln1_b, eps1)
        qkv = (a_in @ w_qkv.t()).view(B, C, w_qkv.shape[0])  # (B, C, 3·H·D)
        r, lse = kernels.causal_attention(qkv, n_head, b_qkv)  # (B, C, H·D), (B, H, C)
        r2 = r.view(B * C, -1)
        x1 = torch.addmm(x0, r2, w_out.t())  # x + R·W_oᵀ
        if b_out is not None:
            x1 += b_out
        f_in, mu2, rs2 = kernels.layer_norm(x1, ln2_w, ln2_b, eps2)
        h = f_in @ w_up.t()  # (B·C, 4E)
        g = kernels.bias_gelu_(h, b_up)  # h += b_up; g = GELU(h)
        y = torch.addmm(x1, g, w_down.t())  # x1 + GELU(h)·W_downᵀ
        if b_down is not None:
            y += b_down
        ctx.save_for_backward(x0, mu1, rs1, a_in, qkv, r2, lse, x1, mu2, rs2, f_in, h,
                              ln1_w, w_qkv, w_out, ln2_w, w_up, w_down)
        ctx.n_head, ctx.shape = n_head, (B, C)
        ctx.biases = (b_qkv is not None, b_out is not None, b_up is not None,
                      b_down is not None)
        return y.view(B, C, E)

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        (x0, mu1, rs1, a_in, qkv, r2, lse, x1, mu2, rs2, f_in, h,
         ln1_w, w_qkv, w_out, ln2_w, w_up, w_down) = ctx.saved_tensors
        need = ctx.needs_input_grad
        has_b_qkv, has_b_out, has_b_up, has_b_down = ctx.biases
        gy = grad_y.contiguous().view(x0.shape)  # (B·C, E)
        # FFN: y = x1 + GELU(f_in·W_upᵀ + b_up)·W_downᵀ + b_down
        grad_f_in, grad_w_up, grad_b_up, grad_w_down = _ffn_backward(
            gy, f_in, h, w_up, w_down, (True, need[12], has_b_up and need[13], need[14]))
        grad_b_down = gy.sum(0) if has_b_down and need[15] else None
        grad_x1, grad_ln2_w, grad_ln2_b = kernels.layer_norm_backward(
            grad_f_in, x1, ln2_w, mu2, rs2, ln2_w is not None and need[10], need[11])
        grad_x1 += gy  # the residual path
        # attention: x1 = x + R·W_oᵀ + b_out, R = attention(LN1(x)·W_qkvᵀ + b_qkv)
        grad_w_out = grad_x1.t() @ r2 if need[8] else None
        grad_b_out = grad_x1.sum(0) if has_b_out and need[9] else None
        grad_r = (grad_x1 @ w_out).view(*ctx.shape, -1)  # (B·C, E)·(E, H·D) -> (B, C, H·D)
        grad_a_in, grad_w_qkv, grad_b_qkv = qkv_attention_backward(
            grad_r, a_in, w_qkv, qkv, r2, lse, ctx.n_head,
            (True, need[6], has_b_qkv and need[7]))
        grad_x, grad_ln1_w, grad_ln1_b = kernels.layer_norm_backward(
            grad_a_in, x0, ln1_w, mu1, rs1, ln1_w is not None and need[4], need[5])
        grad_x += grad_x1  # the residual path
        return (grad_x.view(grad_y.shape), None, None, None, grad_ln1_w, grad_ln1_b,
                grad_w_qkv, grad_b_qkv, grad_w_out, grad_b_out, grad_ln2_w, grad_ln2_b,
                grad_w_up, grad_b_up, grad_w_down, grad_b_down)


class Block(nn.Module):
    """One Transformer block: x + Attention(Norm(x)), then x + FFN(Norm(x))."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gpt2_layout = config.gpt2_layout  # the fused training step knows only this
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

    def _fusable(self, x: Tensor) -> bool:
        """Whether this training forward can run as one :class:`_BlockFn`: GPT-2's layout
        (``config.gpt2_layout``), gradients on, no dropout, plain LayerNorm/Linear parts
        (not e.g. tinylm.lowrank's), nothing hooked, and float32 CPU shapes the native
        kernels take (``attn._native``)."""
        attn, ffn, ln1, ln2 = self.attn, self.ffn, self.ln1, self.ln2
        return (self.gpt2_layout and torch.is_grad_enabled()
                and not (self.drop.training and self.drop.p > 0)
                and not (ffn.drop.training and ffn.drop.p > 0)
                and type(ln1) is nn.LayerNorm and type(ln2) is nn.LayerNorm
                and type(ffn.up) is nn.Linear and type(ffn.down) is nn.Linear
                and attn._native(x)
                and not hooked(ln1, attn, ln2, ffn, ffn.up, ffn.act, ffn.down))

    def forward(self, x: Tensor, cache: KVCache | None = None, layer: int = 0,
                return_weights: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        if cache is None and not return_weights and self._fusable(x):
            attn, ffn, ln1, ln2 = self.attn, self.ffn, self.ln1, self.ln2
            return _BlockFn.apply(  # LayerNorm weight/bias may be None
                x, attn.n_head, ln1.eps, ln2.eps, ln1.weight, ln1.bias,
                attn.qkv.weight, attn.qkv.bias, attn.out.weight, attn.out.bias,
                ln2.weight, ln2.bias, ffn.up.weight, ffn.up.bias, ffn.down.weight,
                ffn.down.bias)
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

    def _embed(self, ids: Tensor, start: int) -> Tensor:
        B, C = ids.shape
        if start + C > self.config.context_length:
            raise ConfigError(
                f"sequence of {start + C} tokens is longer than the model's context_length "
                f"{self.config.context_length}; shorten the input or slide a window"
            )
        x = self.tok_emb(ids)  # (B, C, E)
        if self.pos_emb is not None:  # learned positions; RoPE acts inside attention
            x = x + self.pos_emb(torch.arange(start, start + C, device=ids.device))  # + (C, E)
        return _dropout(self.drop, x)

    def hidden_states(self, ids: Tensor, cache: KVCache | None = None) -> Tensor:
        """ids (B, C) -> final-normed hidden states (B, C, E)."""
        start = cache.length if cache is not None else 0
        x = self._embed(ids, start)
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
