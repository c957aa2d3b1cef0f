"""Looking inside a model: the seed's next-token table, attention maps, neighbours.

The seed's table (SEED-MATH.md section 5, "This is a pen ."): one forward pass over the
C prompt tokens gives C next-token distributions, (C, V). Row t is the distribution of
the token *after* position t given tokens 0..t:

    t  token   next-token candidates
    0  This    is 0.41   was 0.10 ...      <- after "This"
    1  is      a 0.52    the 0.08 ...      <- after "This is"

:func:`explain` computes that table and every attention map (L, H, C, C) in one pass
through the explicit attention path (``GPT.forward_with_attention``); the tests prove
those maps are the weights the fast SDPA path uses. Renderers turn an
:class:`Explanation` into an aligned terminal table, JSON rows, a PNG grid of heatmaps
(matplotlib, imported lazily, Agg canvas) and a self-contained offline HTML page.
:func:`nearest_tokens` lists the tokens closest to one token in embedding space.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import unicodedata
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.attention import (
    MultiHeadAttention,
    RMSNorm,
    apply_rope,
    attention_weights,
    causal_mask,
    explicit_attention,
    repeat_kv,
    rope_angles_at,
)
from tinylm.core.checks import check_int
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT, FeedForward, GatedFeedForward, ReLUSquared
from tinylm.io.checkpoint import nonfinite_error
from tinylm.io.checkpoint_files import unwrap_model
from tinylm.io.files import atomic_write_with

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Candidate:
    """One next-token candidate: its display text, id and probability."""

    token: str
    id: int
    prob: float


@dataclass(frozen=True)
class Row:
    """Row t of the table: the token at position t and the top-k candidates for t+1."""

    position: int
    token: str
    id: int
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True)
class Explanation:
    """The result of :func:`explain` for one prompt of C tokens.

    ids, tokens  the prompt's ids and their display strings, length C
    rows         the next-token table, one :class:`Row` per position
    probs        (C, V) next-token distributions (softmax of the logits), fp32 CPU
    attention    (L, H, C, C) attention maps, lower-triangular, rows summing to 1
    """

    ids: tuple[int, ...]
    tokens: tuple[str, ...]
    rows: tuple[Row, ...]
    probs: Tensor
    attention: Tensor

    def to_json(self) -> list[dict[str, Any]]:
        """The rows as ``tinylm explain --json`` prints them."""
        return [
            {"position": r.position, "token": r.token, "id": r.id,
             "candidates": [{"token": c.token, "id": c.id, "prob": c.prob}
                            for c in r.candidates]}
            for r in self.rows
        ]


# --- computing ------------------------------------------------------------------------


def _check_top_k(top_k: Any) -> None:
    check_int("top-k", top_k, hint="use --top-k 5")


def next_token_rows(probs: Tensor, ids: Sequence[int], tokenizer: Any, top_k: int = 5
                    ) -> tuple[Row, ...]:
    """The seed's table from next-token distributions probs (C, V) of the prompt ``ids``.

    Row t pairs token ids[t] with the top_k most probable next tokens (ties broken by
    id); top_k larger than V shows the whole vocabulary.
    """
    _check_top_k(top_k)
    k = min(top_k, probs.shape[-1])
    top = torch.topk(probs.float(), k, dim=-1)  # values, indices: (C, k)
    rows = []
    for t, token_id in enumerate(ids):
        cands = tuple(
            Candidate(token_text(tokenizer, i), int(i), float(p))
            for p, i in zip(top.values[t].tolist(), top.indices[t].tolist(), strict=True)
        )
        rows.append(Row(t, token_text(tokenizer, token_id), int(token_id), cands))
    return tuple(rows)


def token_text(tokenizer: Any, i: int) -> str:
    """The tokenizer's display text for id i; ids past its vocabulary (a model whose
    embedding has spare rows) show as ``<unused i>``."""
    return tokenizer.id_to_token(int(i)) if int(i) < tokenizer.vocab_size else f"<unused {i}>"


def encode_prompt(tokenizer: Any, prompt: str | Sequence[int], context_length: int
                  ) -> list[int]:
    """The prompt's ids, checked to be non-empty and to fit the context.

    A prompt longer than the context is an error rather than silently explaining only
    its tail: every row of the table would otherwise be computed without the text the
    user believes it sees.
    """
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
    if not ids:
        raise DataError("the prompt is empty (0 tokens); pass some text with --prompt")
    if len(ids) > context_length:
        raise DataError(f"the prompt is {len(ids)} tokens but the model's context length is "
                        f"{context_length}; shorten the prompt to at most {context_length} "
                        f"tokens")
    return ids


def explain(model: nn.Module, tokenizer: Any, prompt: str | Sequence[int], *,
            top_k: int = 5, device: torch.device | str | None = None) -> Explanation:
    """Next-token table and attention maps of ``prompt`` (text, or a list of ids).

    One forward pass through the explicit attention path: logits (1, C, V) and maps
    (L, 1, H, C, C), in fp32 under inference mode; the model's train/eval mode is
    restored afterwards. ``device`` defaults to the model's (the model is moved if
    another is given).
    """
    _check_top_k(top_k)
    base = unwrap_model(model)
    ids = encode_prompt(tokenizer, prompt, base.config.context_length)
    if max(ids) >= base.config.vocab_size:
        raise DataError(f"token id {max(ids)} is outside the model's vocabulary of "
                        f"{base.config.vocab_size}; the tokenizer does not belong to this model")
    if device is not None:
        base.to(device)
    dev = next(base.parameters()).device
    was_training = base.training
    base.eval()
    try:
        with torch.inference_mode():
            x = torch.tensor([ids], dtype=torch.long, device=dev)  # (1, C)
            logits, maps = base.forward_with_attention(x)  # (1, C, V), (L, 1, H, C, C)
    finally:
        base.train(was_training)
    if not bool(torch.isfinite(logits).all()):
        raise nonfinite_error(base, "the next-token logits of the prompt")
    probs = F.softmax(logits[0].float(), dim=-1).cpu()  # (C, V)
    attention = maps[:, 0].float().cpu()  # (L, 1, H, C, C) -> (L, H, C, C)
    rows = next_token_rows(probs, ids, tokenizer, top_k)
    return Explanation(tuple(ids), tuple(r.token for r in rows), rows, probs, attention)


# --- the trace: every intermediate of one forward pass ----------------------------------

# ModelConfig fields the trace knows: every architecture option tinylm builds (LayerNorm
# or RMSNorm, learned or rotary positions, GELU / ReLU² / SwiGLU FFNs, grouped-query
# attention, QK-norm, QKV-only biases, tied or untied heads). A field it has never heard
# of (a subclass's variant) must be at its default, else the trace refuses the model
# rather than compute numbers that are not the model's.
_KNOWN_FIELDS = frozenset({"vocab_size", "context_length", "n_layer", "n_head", "n_embd",
                           "head_dim", "dropout", "bias", "tie_embeddings", "layer_norm_eps",
                           "norm_eps", "rope_theta", "ffn_hidden", "qkv_bias", "norm",
                           "position", "mlp", "qk_norm", "n_kv_head"})

# The shape of each traced value in the note's letters, by the last part of its name.
SHAPES = {
    "tok": "(C, E)", "pos": "(C, E)", "embed": "(C, E)", "resid_pre": "(C, E)",
    "ln1": "(C, E)", "q": "(C, D)", "k": "(C, D)", "v": "(C, D)", "scores": "(C, C)",
    "scaled": "(C, C)", "masked": "(C, C)", "attn": "(C, C)", "out": "(C, D)",
    "contrib": "(C, E)", "concat": "(C, H·D)", "attn_concat": "(C, E)", "attn_out": "(C, E)",
    "resid_mid": "(C, E)", "ln2": "(C, E)", "ffn_pre": "(C, F)", "ffn_post": "(C, F)",
    "ffn_out": "(C, E)", "resid_post": "(C, E)", "final_norm": "(C, E)", "logits": "(C, V)",
}
# ... and of the values only the variants have (QK-norm, RoPE, SwiGLU).
VARIANT_SHAPES = {"q_lin": "(C, D)", "k_lin": "(C, D)", "q_normed": "(C, D)",
                  "k_normed": "(C, D)", "ffn_gate": "(C, F)"}


@dataclass(frozen=True)
class Trace:
    """Every intermediate of one forward pass over C tokens, fp32 CPU, by stable name.

    ``embed.tok``, ``embed.pos`` (learned positions only), ``embed`` (C, E); per layer l
    ``layer{l}.resid_pre``, ``.ln1`` (the x of the note: LayerNorm or RMSNorm of it), per
    query head i ``layer{l}.head{i}.q_lin`` / ``.k_lin`` (x·W + b, (C, D)), with QK-norm
    ``.q_normed`` / ``.k_normed`` (under RoPE; without it they are the final q, k), then
    ``.q`` / ``.k`` (what enters the scores: rotated by position under RoPE) and ``.v``;
    ``_lin`` exists only where a stage follows it. Under grouped-query attention head i's
    ``k*`` and ``v`` are those of key/value head i // (H / H_kv). ``.scores`` = Q·Kᵀ,
    ``.scaled`` = Q·Kᵀ/√D, ``.masked`` (−inf above the diagonal), ``.attn`` = softmax
    (C, C), ``.out`` = R^i = A·V (C, D),
    ``.contrib`` = R^i·W_o^i (C, E); then ``layer{l}.concat`` [R^1 … R^H] (C, H·D),
    ``.attn_concat`` ([R^1 … R^H]·W_o + b_o), ``.attn_out`` (Σ_i R^i·W_o^i + b_o, what the
    residual gets), ``.resid_mid``, ``.ln2``, ``.ffn_pre`` (the up projection, (C, F)),
    ``.ffn_gate`` (SwiGLU's gate projection), ``.ffn_post`` (after the activation: GELU,
    ReLU², or SiLU(gate)·up), ``.ffn_out``, ``.resid_post``; finally ``final_norm`` (C, E)
    and ``logits`` (C, V). ``shape(name)`` gives the letters, ``sizes`` their values.
    """

    ids: tuple[int, ...]
    sizes: dict[str, int]
    values: dict[str, Tensor]
    ablated: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> Tensor:
        return self.values[name]

    def __contains__(self, name: object) -> bool:
        return name in self.values

    def names(self) -> list[str]:
        return list(self.values)

    @staticmethod
    def shape(name: str) -> str:
        """The shape of ``name`` in the note's letters, e.g. ``(C, D)``."""
        last = name.rsplit(".", 1)[-1]
        return SHAPES[last] if last in SHAPES else VARIANT_SHAPES[last]


def _norm_kind(cfg: Any) -> type:
    return RMSNorm if cfg.norm == "rmsnorm" else nn.LayerNorm


def _expected_parts(base: GPT) -> list[tuple[str, Any, type]]:
    """(what, module, the type the config says it is) for every part the trace reads."""
    cfg = base.config
    norm = _norm_kind(cfg)
    parts = [("final norm", base.final_norm, norm)]
    if cfg.position == "learned":
        parts.append(("position embedding", base.pos_emb, nn.Embedding))
    ffn = GatedFeedForward if cfg.mlp == "swiglu" else FeedForward
    act = {"gelu": nn.GELU, "relu2": ReLUSquared}.get(cfg.mlp)
    for l, b in enumerate(base.blocks):
        parts += [(f"layer {l} ln1", b.ln1, norm), (f"layer {l} ln2", b.ln2, norm),
                  (f"layer {l} attention", b.attn, MultiHeadAttention),
                  (f"layer {l} FFN", b.ffn, ffn)]
        if act is not None:
            parts.append((f"layer {l} FFN activation", getattr(b.ffn, "act", None), act))
        if cfg.qk_norm:
            parts += [(f"layer {l} QK-norm", b.attn.q_norm, RMSNorm),
                      (f"layer {l} QK-norm", b.attn.k_norm, RMSNorm)]
    return parts


def check_traceable(model: nn.Module) -> GPT:
    """The plain GPT under ``model``, or a ConfigError when the trace does not know its
    architecture (a part it does not know would give numbers that are not the model's)."""
    base = unwrap_model(model)
    if not isinstance(base, GPT):
        raise ConfigError(f"the explorer traces tinylm's GPT, not {type(base).__name__}; "
                          f"load a tinylm checkpoint")
    cfg = base.config
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name not in _KNOWN_FIELDS and value != f.default:
            raise ConfigError(f"the explorer does not know the architecture {f.name}="
                              f"{value!r} yet (it traces tinylm's: LayerNorm/RMSNorm, "
                              f"learned/rotary positions, GELU/ReLU²/SwiGLU, GQA, QK-norm)")
    for what, module, kind in _expected_parts(base):
        if type(module) is not kind:
            raise ConfigError(f"the explorer does not know this model's {what} "
                              f"({type(module).__name__}, expected {kind.__name__}); it "
                              f"traces the modules tinylm's config builds")
    return base


def ablation_keys(n_layer: int, n_head: int) -> list[str]:
    """Every single ablation :func:`trace` takes: ``layer{l}.head{i}``, ``layer{l}.attn``
    (the whole attention of layer l) and ``layer{l}.ffn``."""
    keys = []
    for l in range(n_layer):
        keys += [f"layer{l}.head{i}" for i in range(n_head)] + [f"layer{l}.attn",
                                                                  f"layer{l}.ffn"]
    return keys


def _ablation_masks(keys: Sequence[str], n_layer: int, n_head: int
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Per layer, which batch row keeps which head (L, K, H), its attention (L, K) and
    its FFN (L, K): 1 = on, 0 = switched off by that row's key."""
    known = set(ablation_keys(n_layer, n_head))
    unknown = [a for a in keys if a not in known]
    if unknown:
        raise ConfigError(f"unknown ablation {unknown[0]!r}; use layer<l>.head<i>, "
                          f"layer<l>.attn or layer<l>.ffn with l < {n_layer}, i < {n_head}")
    heads = torch.ones(n_layer, len(keys), n_head)
    attn, ffn = torch.ones(n_layer, len(keys)), torch.ones(n_layer, len(keys))
    for row, key in enumerate(keys):
        layer, part = key.split(".")
        l = int(layer[len("layer"):])
        if part == "attn":
            attn[l, row] = 0
        elif part == "ffn":
            ffn[l, row] = 0
        else:
            heads[l, row, int(part[len("head"):])] = 0
    return heads, attn, ffn


def _ablated_run(base: GPT, x: Tensor, start: int, masks: tuple[Tensor, Tensor, Tensor]
                 ) -> Tensor:
    """Blocks start.. of x (K, C, E), each row with its own parts switched off (the 0/1
    factors of :func:`_ablation_masks`), then the final norm and the LM head."""
    heads, attn_on, ffn_on = masks
    K, C, _ = x.shape
    mask = causal_mask(C, device=x.device)
    for l in range(start, len(base.blocks)):
        block = base.blocks[l]
        att = block.attn
        q, k, v = att._heads(block.ln1(x))  # (K, H, C, D), 2 × (K, H_kv, C, D)
        n_rep = att.n_head // att.n_kv_head
        r, _ = explicit_attention(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), mask)
        r = r * heads[l].to(r)[:, :, None, None]  # (K, H, C, D)
        a = att.out(r.transpose(1, 2).reshape(K, C, -1))  # (K, C, E)
        x = x + a * attn_on[l].to(a)[:, None, None]
        f = block.ffn(block.ln2(x))
        x = x + f * ffn_on[l].to(f)[:, None, None]
    return base.lm_head(base.final_norm(x))  # (K, C, V)


#: The most ablation logits one batched pass holds (rows x C x V float32): a pass takes
#: as many rows as fit (at most ``chunk``, at least one) and each row is reduced at once,
#: so an explore's peak memory is that of one forward's logits (C x V) plus this, whatever
#: its layers x heads.
ABLATION_BYTES = 32 * 2**20


def ablation_rows_per_pass(n_tokens: int, vocab_size: int, chunk: int = 16,
                           max_bytes: int | None = None) -> int:
    """How many ablations one batched pass of :func:`reduce_ablations` runs together:
    as many as ``max_bytes`` of logits hold (default :data:`ABLATION_BYTES`), 1 to chunk."""
    budget = ABLATION_BYTES if max_bytes is None else max_bytes
    return max(1, min(chunk, budget // max(1, 4 * n_tokens * vocab_size)))


def reduce_ablations(model: nn.Module, ids: Sequence[int], keys: Sequence[str],
                     reduce: Callable[[str, Tensor], Any], *, residual: Tensor | None = None,
                     start: int = 0, chunk: int = 16, max_bytes: int | None = None
                     ) -> list[Any]:
    """``reduce(key, logits)`` for each key, in order, where ``logits`` (C, V) fp32 is what
    ``trace(model, ids, ablate=[key])["logits"]`` gives, through the same modules (heads,
    attention and FFN masked by 0/1 factors). The keys run in batched passes of
    :func:`ablation_rows_per_pass` rows and each row is reduced before the next pass, so
    no more than one pass's logits exist at once (never K x C x V). With ``residual``
    (C, E), the residual stream entering block ``start`` (every key then names a layer
    >= start), the blocks before it are not run again."""
    base = check_traceable(model)
    cfg = base.config
    masks = _ablation_masks(keys, cfg.n_layer, cfg.n_head)
    rows = ablation_rows_per_pass(len(ids), cfg.vocab_size, chunk, max_bytes)
    dev = next(base.parameters()).device
    was_training = base.training
    base.eval()
    out: list[Any] = []
    try:
        with torch.no_grad():
            if residual is None:
                x = torch.tensor(list(ids), dtype=torch.long, device=dev)
                x, start = base._embed(x[None], 0)[0], 0
            else:
                x = residual.to(dev, next(base.parameters()).dtype)
            for b in range(0, len(keys), rows):
                part = tuple(m[:, b:b + rows] for m in masks)
                n = part[1].shape[1]
                logits = _ablated_run(base, x.expand(n, -1, -1), start, part)  # (n, C, V)
                out += [reduce(keys[b + j], logits[j].float()) for j in range(n)]
                del logits
    finally:
        base.train(was_training)
    return out


def ablated_logits(model: nn.Module, ids: Sequence[int], keys: Sequence[str], *,
                   residual: Tensor | None = None, start: int = 0, chunk: int = 16) -> Tensor:
    """The logits with one part switched off per key, (K, C, V) fp32 CPU: row b is what
    ``trace(model, ids, ablate=[keys[b]])["logits"]`` gives (see :func:`reduce_ablations`,
    which the explorer uses instead: this holds all K rows, K x C x V floats)."""
    rows = reduce_ablations(model, ids, keys, lambda _, logits: logits.cpu().clone(),
                            residual=residual, start=start, chunk=chunk)
    V = unwrap_model(model).config.vocab_size
    return torch.stack(rows) if rows else torch.zeros(0, len(ids), V)


def _trace_heads(attn: MultiHeadAttention, x: Tensor, p: str, v: dict[str, Tensor]) -> None:
    """Each head's q, k, v (C, D), and where there are stages, each named: x·W + b
    (``_lin``), the QK-norm (``_normed``), then the rotation by position (the final q, k),
    through the same modules and functions as the model's. Query head i reads key/value
    head i // (H / H_kv): its k and v are that head's tensors."""
    C, H, Hkv, D = x.shape[0], attn.n_head, attn.n_kv_head, attn.head_dim
    q, k, val = attn.qkv(x).split([H * D, Hkv * D, Hkv * D], dim=-1)  # [q | k | v]
    q, k, val = (t.view(C, -1, D).transpose(0, 1) for t in (q, k, val))  # (heads, C, D)
    stages = []
    if attn.q_norm is not None or attn.rope_theta is not None:
        stages.append(("_lin", q, k))
    if attn.q_norm is not None and attn.rope_theta is not None:
        stages.append(("_normed", attn.q_norm(q), attn.k_norm(k)))
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)  # RMSNorm over each head's D
    if attn.rope_theta is not None:
        cos, sin = rope_angles_at(torch.arange(C, device=x.device), D, attn.rope_theta)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)  # (C, D) angles, broadcast
    stages.append(("", q, k))
    n_rep = H // Hkv
    for i in range(H):
        h = f"{p}head{i}."
        v[h + "v"] = val[i // n_rep]
        for suffix, qs, ks in stages:
            v[h + "q" + suffix], v[h + "k" + suffix] = qs[i], ks[i // n_rep]


def _trace_attention(attn: MultiHeadAttention, x: Tensor, p: str, v: dict[str, Tensor],
                     ablate: frozenset[str]) -> Tensor:
    """One layer's attention head by head, the note's steps; returns Σ_i R^i·W_o^i + b_o."""
    C, H, D = x.shape[0], attn.n_head, attn.head_dim
    _trace_heads(attn, x, p, v)
    mask = causal_mask(C, device=x.device)  # (C, C), True on and below the diagonal
    w_o = attn.out.weight  # (E, H·D): column block i is W_o^i transposed
    heads, total = [], torch.zeros(C, w_o.shape[0], dtype=x.dtype, device=x.device)
    for i in range(H):
        h = f"{p}head{i}."
        q, k, val = v[h + "q"], v[h + "k"], v[h + "v"]  # (C, D) each
        v[h + "scores"] = q @ k.t()  # (C, D)·(D, C) -> (C, C)
        v[h + "scaled"] = v[h + "scores"] / math.sqrt(D)
        v[h + "masked"] = v[h + "scaled"].masked_fill(~mask, float("-inf"))
        v[h + "attn"] = attention_weights(v[h + "scaled"], mask)  # softmax over keys
        r = v[h + "attn"] @ val  # (C, C)·(C, D) -> (C, D)
        if f"{p}head{i}" in ablate:
            r = torch.zeros_like(r)
        v[h + "out"] = r
        v[h + "contrib"] = r @ w_o[:, i * D:(i + 1) * D].t()  # (C, D)·(D, E) -> (C, E)
        heads.append(r)
        total = total + v[h + "contrib"]
    v[p + "concat"] = torch.cat(heads, dim=-1)  # (C, H·D)
    v[p + "attn_concat"] = attn.out(v[p + "concat"])  # concat form: one product with W_o
    if attn.out.bias is not None:
        total = total + attn.out.bias
    return torch.zeros_like(total) if p + "attn" in ablate else total


def _trace_ffn(ffn: nn.Module, x: Tensor, p: str, v: dict[str, Tensor]) -> Tensor:
    """The FFN's steps: up (and SwiGLU's gate) (C, F), the activation, down (C, E)."""
    v[p + "ffn_pre"] = ffn.up(x)  # (C, E) -> (C, F)
    if isinstance(ffn, GatedFeedForward):
        v[p + "ffn_gate"] = ffn.gate(x)
        v[p + "ffn_post"] = F.silu(v[p + "ffn_gate"]) * v[p + "ffn_pre"]
    else:
        v[p + "ffn_post"] = ffn.act(v[p + "ffn_pre"])  # GELU or ReLU²
    return ffn.down(v[p + "ffn_post"])  # (C, F) -> (C, E)


def _trace_values(base: GPT, ids: Tensor, ablate: frozenset[str]) -> dict[str, Tensor]:
    v: dict[str, Tensor] = {}
    x = v["embed.tok"] = base.tok_emb(ids)  # (C,) -> (C, E): row ids[t] of the (V, E) table
    if base.pos_emb is not None:  # learned positions; RoPE rotates q and k instead
        v["embed.pos"] = base.pos_emb(torch.arange(ids.shape[0], device=ids.device))
        x = x + v["embed.pos"]
    v["embed"] = x
    for l, block in enumerate(base.blocks):
        p = f"layer{l}."
        v[p + "resid_pre"] = x
        v[p + "ln1"] = block.ln1(x)
        v[p + "attn_out"] = _trace_attention(block.attn, v[p + "ln1"], p, v, ablate)
        x = v[p + "resid_mid"] = x + v[p + "attn_out"]
        v[p + "ln2"] = block.ln2(x)
        v[p + "ffn_out"] = _trace_ffn(block.ffn, v[p + "ln2"], p, v)
        if p + "ffn" in ablate:
            v[p + "ffn_out"] = torch.zeros_like(v[p + "ffn_out"])
        x = v[p + "resid_post"] = x + v[p + "ffn_out"]
    v["final_norm"] = base.final_norm(x)
    v["logits"] = base.lm_head(v["final_norm"])  # (C, E) -> (C, V)
    return v


def trace(model: nn.Module, ids: Sequence[int] | Tensor, *,
          ablate: Sequence[str] = (), check: bool = True) -> Trace:
    """Every intermediate of the forward pass over ``ids`` (C tokens), see :class:`Trace`.

    Computed head by head through the model's own modules (the norms, the QKV and
    output projections, QK-norm, RoPE, the FFN, the LM head) in eval mode without
    gradients; the values are fp32 on the CPU. ``ablate`` switches parts off (keys from
    :func:`ablation_keys`): a head's R^i becomes 0, a layer's attention or FFN adds 0
    to the residual stream. Without ablation the traced logits are checked against
    the model's own forward (``check``), so a model the trace misreads is refused
    instead of explained wrongly.
    """
    base = check_traceable(model)
    cfg = base.config
    flat = ids.reshape(-1).tolist() if isinstance(ids, Tensor) else [int(i) for i in ids]
    if not flat or len(flat) > cfg.context_length:
        raise DataError(f"trace needs 1 to {cfg.context_length} tokens, got {len(flat)}")
    if min(flat) < 0 or max(flat) >= cfg.vocab_size:
        raise DataError(f"token ids must be in [0, {cfg.vocab_size}), got {min(flat)}.."
                        f"{max(flat)}; the tokenizer does not belong to this model")
    _ablation_masks(ablate, cfg.n_layer, cfg.n_head)  # checks the keys
    dev = next(base.parameters()).device
    was_training = base.training
    base.eval()
    try:
        with torch.no_grad():  # not inference mode: the values stay usable with autograd
            x = torch.tensor(flat, dtype=torch.long, device=dev)
            values = _trace_values(base, x, frozenset(ablate))
            reference = base(x[None])[0] if check and not ablate else None
    finally:
        base.train(was_training)
    values = {k: t.float().cpu() for k, t in values.items()}
    if not bool(torch.isfinite(values["logits"]).all()):
        raise nonfinite_error(base, "the traced logits" + (" (with " + ", ".join(ablate)
                                                          + " switched off)" if ablate else ""))
    if reference is not None:  # compared in place: no (C, V) temporaries beside the two
        reference = reference.float().cpu()
        scale = max(1.0, float(reference.max()), -float(reference.min()))
        reference.sub_(values["logits"])
        gap = max(float(reference.max()), -float(reference.min()))
        del reference
        if not gap <= 1e-3 * scale:
            raise ConfigError(f"the explorer's trace does not reproduce this model's logits "
                              f"(max difference {gap:.3g}); its architecture is not one the "
                              f"trace knows")
    sizes = {"C": len(flat), "E": cfg.n_embd, "H": cfg.n_head, "D": cfg.head_dim,
             "F": base.blocks[0].ffn.up.out_features, "V": cfg.vocab_size, "L": cfg.n_layer}
    return Trace(tuple(flat), sizes, values, tuple(ablate))


@dataclass(frozen=True)
class Neighbour:
    """A token near the query token in embedding space (cosine similarity in [-1, 1])."""

    token: str
    id: int
    similarity: float


def token_id_of(tokenizer: Any, token: str) -> int:
    """The id of one token: its text, its spelling in the table (``␣`` for a space,
    ``\\n`` for a newline, as :func:`display_token` shows it), or text encoding to one token."""
    undisplayed = token.replace("\\n", "\n").replace("\\t", "\t").replace("\\r", "\r")
    for spelling in dict.fromkeys([token, undisplayed.replace("␣", " ")]):
        found = tokenizer.token_to_id(spelling)
        if found is not None:
            return int(found)
    ids = tokenizer.encode(token) if token else []
    if len(ids) == 1:
        return int(ids[0])
    shown = ", ".join(repr(tokenizer.id_to_token(i)) for i in ids[:8])
    raise DataError(f"{token!r} is not a single token of this {tokenizer.kind} tokenizer "
                    f"(it encodes to {len(ids)} tokens{': ' + shown if ids else ''}); pass "
                    f"one token, e.g. one from the 'tinylm explain' table")


def nearest_tokens(model: nn.Module, tokenizer: Any, token: str, count: int = 10
                   ) -> list[Neighbour]:
    """The ``count`` tokens whose embedding rows (tok_emb, (V, E)) have the highest
    cosine similarity with ``token``'s, most similar first; the token itself leads."""
    check_int("count", count, hint="use --count 10")
    base = unwrap_model(model)
    query = token_id_of(tokenizer, token)
    with torch.inference_mode():
        emb = base.tok_emb.weight.detach().float().cpu()  # (V, E)
        if query >= emb.shape[0]:
            raise DataError(f"token {token!r} has id {query}, outside the model's vocabulary "
                            f"of {emb.shape[0]}; the tokenizer does not belong to this model")
        sims = F.cosine_similarity(emb, emb[query][None, :], dim=-1)  # (V, E) vs (1, E) -> (V,)
        if not bool(torch.isfinite(sims).all()):
            raise nonfinite_error(base, "the cosine similarities of its token embeddings")
        sims[query] = 1.0  # exactly, whatever the rounding
    order = sorted(range(emb.shape[0]), key=lambda i: (-float(sims[i]), i != query, i))
    return [Neighbour(token_text(tokenizer, i), i, float(sims[i]))
            for i in order[:min(count, emb.shape[0])]]


# --- rendering: terminal ----------------------------------------------------------------

_ESCAPES = {" ": "␣", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def display_token(token: str) -> str:
    """A token with whitespace made visible: space -> ␣, newline -> \\n, tab -> \\t, other
    control characters as \\xNN, so a terminal table stays on one line per row."""
    out = []
    for ch in token:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp"):
            out.append(f"\\x{ord(ch):02x}" if ord(ch) < 256 else f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out) or "∅"


def display_width(text: str) -> int:
    """Terminal columns of ``text``: East Asian wide characters take two."""
    return sum(0 if unicodedata.combining(c) else
               2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def _pad(text: str, width: int) -> str:
    return text + " " * max(0, width - display_width(text))


def format_table(explanation: Explanation) -> str:
    """The next-token table as aligned text: position, token, then the candidates.

    Row t's candidates are the distribution of the token after position t given
    tokens 0..t (the seed's "This is a pen ." table, top-k per row).
    """
    rows = explanation.rows
    k = max(len(r.candidates) for r in rows)
    cells = [[f"{display_token(c.token)} {c.prob:.3f}" for c in r.candidates] for r in rows]
    tok_w = max([display_width("token")] + [display_width(display_token(r.token)) for r in rows])
    pos_w = max(1, len(str(len(rows) - 1)))
    col_w = [max([display_width(row[j]) for row in cells if j < len(row)] + [4])
             for j in range(k)]
    head = f"{'t':>{pos_w}}  {_pad('token', tok_w)}  next-token candidates (top {k})"
    lines = [head]
    for r, row in zip(rows, cells, strict=True):
        text = "  ".join(_pad(c, col_w[j]) for j, c in enumerate(row)).rstrip()
        lines.append(f"{r.position:>{pos_w}}  {_pad(display_token(r.token), tok_w)}  {text}")
    return "\n".join(lines)


def format_neighbours(token: str, neighbours: Sequence[Neighbour]) -> str:
    """An aligned list: rank, token, id, cosine similarity."""
    w = max(display_width(display_token(n.token)) for n in neighbours)
    lines = [f"tokens nearest to {display_token(token)!s} (cosine similarity of embeddings)"]
    for rank, n in enumerate(neighbours):
        lines.append(f"{rank:>3}  {_pad(display_token(n.token), w)}  id {n.id:<6}  "
                     f"{n.similarity:+.4f}")
    return "\n".join(lines)


# --- rendering: PNG ---------------------------------------------------------------------


# Picture formats --attention writes, by file suffix (matplotlib's own writers).
PICTURE_FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".svg": "svg", ".pdf": "pdf"}


def picture_format(path: str | os.PathLike) -> str:
    """The format a picture's file name asks for (``maps.svg`` -> ``svg``), or a
    ConfigError: a name whose suffix names no format we write is refused, never
    filled with bytes of another format."""
    out = Path(path)
    fmt = PICTURE_FORMATS.get(out.suffix.lower())
    if fmt is None:
        what = f"'{out.suffix}' is not a picture format it writes" if out.suffix else \
            "it has no suffix naming a format"
        raise ConfigError(f"cannot draw the attention maps into {out}: {what}; end the name "
                          f"with {', '.join(PICTURE_FORMATS)}")
    if out.is_dir():
        raise ConfigError(f"cannot draw the attention maps into {out}: it is a folder; pass "
                          f"a file name such as {out / 'maps.png'}")
    return fmt


def plot_attention(explanation: Explanation, path: str | os.PathLike, *,
                   max_labels: int = 48) -> Path:
    """Draw every attention map as a grid (layers × heads) of heatmaps and save a PNG.

    Cell (l, h) shows layer l, head h: row i = query token i, column j = key token j,
    colour = weight; the masked upper triangle is left blank. Axes are labelled with the
    tokens when there are at most ``max_labels`` of them. The format is the one the
    suffix names (:data:`PICTURE_FORMATS`: PNG, JPEG, SVG, PDF); the file is written
    under a temporary name and renamed into place.
    """
    fmt = picture_format(path)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ConfigError("drawing attention maps needs matplotlib; install it with: "
                          "pip install 'tinylm[plot]'") from exc
    import numpy as np

    maps = explanation.attention.numpy()  # (L, H, C, C)
    L, H, C, _ = maps.shape
    labels = [display_token(t) for t in explanation.tokens]
    show = C <= max_labels
    cell = max(2.0, min(6.0, 0.22 * C + 1.2))
    cell = min(cell, 48.0 / max(L, H))  # keep big grids (GPT-2: 12 × 12) under ~5,000 px
    fig = Figure(figsize=(cell * H + 1.2, cell * L + 0.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(L, H, squeeze=False)
    upper = np.triu(np.ones((C, C), dtype=bool), k=1)
    image = None
    for layer in range(L):
        for head in range(H):
            ax = axes[layer][head]
            masked = np.ma.array(maps[layer, head], mask=upper)
            image = ax.imshow(masked, vmin=0.0, vmax=1.0, cmap="viridis",
                              interpolation="nearest")
            ax.set_title(f"layer {layer} head {head}", fontsize=9)
            if show:
                ax.set_xticks(range(C), labels, rotation=90, fontsize=7)
                ax.set_yticks(range(C), labels, fontsize=7)
            else:
                ax.set_xticks([])
                ax.set_yticks([])
            ax.set_facecolor("white")
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    fig.suptitle("attention maps: row = query token, column = key token (causal)", fontsize=10)
    out = Path(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        atomic_write_with(out, lambda tmp: fig.savefig(tmp, format=fmt, dpi=110))
    missing = {str(w.message) for w in caught if "missing from font" in str(w.message)}
    if missing:
        log.info("%d character(s) in the token labels have no glyph in matplotlib's font and "
                 "show as boxes in %s", len(missing), out)
    for w in caught:
        if "missing from font" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


__all__ = [
    "Candidate",
    "Explanation",
    "Neighbour",
    "Row",
    "PICTURE_FORMATS",
    "SHAPES",
    "Trace",
    "VARIANT_SHAPES",
    "ABLATION_BYTES",
    "ablated_logits",
    "ablation_keys",
    "ablation_rows_per_pass",
    "check_traceable",
    "display_token",
    "encode_prompt",
    "explain",
    "format_neighbours",
    "format_table",
    "nearest_tokens",
    "next_token_rows",
    "picture_format",
    "plot_attention",
    "reduce_ablations",
    "token_id_of",
    "token_text",
    "trace",
]
