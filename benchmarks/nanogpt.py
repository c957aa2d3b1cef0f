"""nanoGPT's model (karpathy/nanoGPT ``model.py``, MIT), restated for the benchmarks: the
same modules, names and computation, so its state dict has nanoGPT's keys and its step
costs what nanoGPT's costs.

- ``LayerNorm`` with an optional bias (``F.layer_norm``, eps 1e-5);
- ``CausalSelfAttention``: one ``c_attn`` Linear to q, k, v (split, heads moved to the
  batch dim by ``view`` + ``transpose``), ``F.scaled_dot_product_attention(is_causal=True)``,
  the heads put back side by side, ``c_proj``;
- ``MLP``: ``c_fc``, exact GELU (``nn.GELU()``), ``c_proj``;
- ``Block``: pre-norm residuals; ``GPT``: ``wte`` + ``wpe``, the blocks, ``ln_f`` and an
  ``lm_head`` tied to ``wte``; ``forward(idx, targets)`` returns (logits, mean
  cross-entropy with ``ignore_index=-1``).

:func:`from_tinylm` copies a tinylm GPT-2-layout model's weights into it. tinylm's GPT-2
uses the tanh GELU (as GPT-2 and Hugging Face's ``gelu_new``), nanoGPT the exact one: the
two models' losses agree to ~1e-4, not bitwise.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    block_size: int
    vocab_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float = 0.0
    bias: bool = True


class LayerNorm(nn.Module):
    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        _b, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is None:
            return self.lm_head(x[:, [-1], :]), None
        logits = self.lm_head(x)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1),
                               ignore_index=-1)
        return logits, loss


#: tinylm's parameter names -> nanoGPT's (per block: ``{i}``).
_NAMES = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
          "final_norm.weight": "transformer.ln_f.weight",
          "final_norm.bias": "transformer.ln_f.bias", "lm_head.weight": "lm_head.weight"}
_BLOCK = {"ln1": "ln_1", "attn.qkv": "attn.c_attn", "attn.out": "attn.c_proj", "ln2": "ln_2",
          "ffn.up": "mlp.c_fc", "ffn.down": "mlp.c_proj"}


def from_tinylm(model) -> GPT:
    """nanoGPT's model with the weights of ``model`` (a tinylm GPT-2-layout GPT with
    biases: q, k, v in one projection in nanoGPT's order already)."""
    c = model.config
    ours = GPT(GPTConfig(block_size=c.context_length, vocab_size=c.vocab_size,
                         n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd,
                         dropout=c.dropout, bias=True))
    names = dict(_NAMES)
    for i in range(c.n_layer):
        for a, b in _BLOCK.items():
            for kind in ("weight", "bias"):
                names[f"blocks.{i}.{a}.{kind}"] = f"transformer.h.{i}.{b}.{kind}"
    state = {names[k]: v.detach().clone() for k, v in model.state_dict().items()}
    missing, unexpected = ours.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if m != "transformer.wte.weight"]:
        raise ValueError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return ours
