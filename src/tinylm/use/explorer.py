"""The attention explorer: one offline page that walks the note's equations on a prompt.

:func:`explorer_data` runs :func:`tinylm.use.inspection.trace` on a prompt and gathers what
the page shows, as one JSON-ready dict: the trace's tensors (float32, base64), the
next-token table, the logit lens, every single ablation (precomputed, so the page needs
no server), and each head's low-rank spectrum. :func:`render_explorer` puts that dict
into the page (``explorer_page/``: HTML, CSS and JavaScript, all inline); the page
refers to no URL. Given an ``endpoint``, the same page also has a prompt box and fetches
a new dict from it (``tinylm serve``'s ``POST /v1/explore`` returns exactly what
:func:`explorer_data` returns): one page, two modes.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.checks import is_int
from tinylm.core.config import resolve_device
from tinylm.core.errors import ConfigError, DataError
from tinylm.core.model import GPT
from tinylm.io.checkpoint import load_checkpoint, require_tokenizer_of
from tinylm.io.checkpoint_files import unwrap_model
from tinylm.io.files import atomic_write_with
from tinylm.use.inspection import (
    Explanation,
    Neighbour,
    Trace,
    ablation_rows_per_pass,
    check_traceable,
    encode_prompt,
    explain,
    nearest_tokens,
    picture_format,
    plot_attention,
    reduce_ablations,
    token_text,
    trace,
)

log = logging.getLogger(__name__)

FORMAT = 2  # the version of explorer_data's layout, read by the page
# Per query head, per key/value head (named by the first query head reading it), per
# layer: the step-by-step tensors of the layers a page carries in full (``detail``).
_HEAD_VALUES = ("q", "q_lin", "q_normed", "scores", "out", "contrib")
_KV_VALUES = ("k", "k_lin", "k_normed", "v")
_LAYER_VALUES = ("ln1", "attn_out", "attn_concat", "ffn_pre", "ffn_gate", "ffn_post",
                 "ffn_out")
#: The default budget of a page's step-by-step tensors (base64 bytes): every layer when
#: they fit, else the opened layer and its neighbours (the live page fetches any other).
DETAIL_BYTES = 6_000_000


def encode_tensor(t: Tensor) -> dict[str, Any]:
    """A tensor as ``{"shape": [...], "f32": URL-safe base64 of its little-endian float32
    bytes}``: exact, a third the size of decimal text, and with no ``/`` in it."""
    raw = t.detach().float().cpu().contiguous().numpy().astype("<f4").tobytes()
    return {"shape": list(t.shape), "f32": base64.urlsafe_b64encode(raw).decode("ascii")}


def decode_tensor(item: dict[str, Any]) -> Tensor:
    """The inverse of :func:`encode_tensor`."""
    import numpy as np

    raw = np.frombuffer(base64.urlsafe_b64decode(item["f32"]), dtype="<f4").copy()
    return torch.from_numpy(raw).view(*item["shape"])


def _top(logits: Tensor, k: int) -> list[list[list[float]]]:
    """Per position the top-k [id, prob] pairs of softmax(logits), (C, V) -> C × k."""
    return _top_of(F.softmax(logits.float(), dim=-1), k)


def _top_of(probs: Tensor, k: int) -> list[list[list[float]]]:
    """Per position the top-k [id, prob] pairs of probs (C, V) -> C × k."""
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return [[[int(i), round(float(p), 6)] for p, i in zip(vals, idx, strict=True)]
            for vals, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True)]


def _logit_lens(base: GPT, tr: Trace, k: int) -> list[dict[str, Any]]:
    """The top-k next tokens read out of the residual stream after the embedding and
    after each layer: softmax(lm_head(final_norm(x))) — the last equals the output."""
    stages = [("embedding", "embed")] + [(f"after layer {l}", f"layer{l}.resid_post")
                                         for l in range(tr.sizes["L"])]
    p = next(base.parameters())
    out = []
    with torch.inference_mode():
        for label, name in stages:
            x = tr[name].to(p.device, p.dtype)
            out.append({"label": label, "name": name,
                        "top": _top(base.lm_head(base.final_norm(x)).float().cpu(), k)})
    return out


def _ablations(base: GPT, tr: Trace, base_top: list[int], k: int, head_layers: Sequence[int],
               whole_layers: bool = True) -> list[dict[str, Any]]:
    """For single ablation keys (each head of ``head_layers``; with ``whole_layers`` each
    layer's attention and FFN), the next-token table with that part switched off and the
    probability it leaves to each position's original top token. Layer l's keys start
    from the traced residual stream entering block l (the blocks before it are unchanged
    by them), and each ablation's logits (C, V) are reduced to those numbers as soon as
    its pass ends (:func:`~tinylm.use.inspection.reduce_ablations`): memory of one pass,
    never layers × heads × C × V."""
    cfg, ids = base.config, list(tr.ids)
    pos, top_ids = torch.arange(len(ids)), torch.tensor(base_top)

    def summary(key: str, logits: Tensor) -> dict[str, Any]:
        probs = F.softmax(logits, dim=-1)  # (C, V)
        return {"key": key, "top": _top_of(probs, k),
                "orig_top_prob": [round(float(p), 6) for p in
                                  probs[pos.to(probs.device), top_ids.to(probs.device)]]}

    out = []
    for l in range(cfg.n_layer):
        keys = [f"layer{l}.head{i}" for i in range(cfg.n_head)] if l in head_layers else []
        keys += [f"layer{l}.attn", f"layer{l}.ffn"] if whole_layers else []
        if keys:
            out += reduce_ablations(base, ids, keys, summary,
                                    residual=tr[f"layer{l}.resid_pre"], start=l)
    return out


def _matrix(linear: nn.Module) -> tuple[Tensor, Tensor | None]:
    """The (in, out) matrix W of x·W + b and b of any Linear-like layer (a plain, low-rank
    or quantized one alike): its outputs for the unit vectors, minus its bias."""
    if type(linear) is nn.Linear:
        w, b = linear.weight.detach().t(), linear.bias
        return w.float().cpu(), None if b is None else b.detach().float().cpu()
    floats = [t for t in [*linear.parameters(), *linear.buffers()] if t.is_floating_point()]
    kw = {"dtype": floats[0].dtype, "device": floats[0].device}
    n_in = linear.in_features
    with torch.no_grad():
        zero = linear(torch.zeros(1, n_in, **kw))[0]
        w = linear(torch.eye(n_in, **kw)) - zero
    bias = getattr(linear, "bias", None)
    return w.float().cpu(), None if bias is None else zero.float().cpu()


def head_weights(base: GPT, layer: int, head: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """W_v^i (E, D), W_o^i (D, E) in the note's x·W orientation, and b_v^i (D,) or None;
    under grouped-query attention W_v^i is that of the key/value head query head i reads."""
    attn = base.blocks[layer].attn
    H, Hkv, D = attn.n_head, attn.n_kv_head, attn.head_dim
    j = head // (H // Hkv)
    cols = slice((H + Hkv + j) * D, (H + Hkv + j + 1) * D)
    w_qkv, b_qkv = _matrix(attn.qkv)  # (E, (H + 2·H_kv)·D)
    w_out, _ = _matrix(attn.out)  # (H·D, E)
    b_v = None if b_qkv is None else b_qkv[cols]
    return w_qkv[:, cols], w_out[head * D:(head + 1) * D], b_v


def _factored_svd(w_v: Tensor, w_o: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The thin SVD u (E, r), s (r,), vh (r, E) of M = W_v·W_o (rank r <= D) without
    forming M: W_v = Q_a·R_a, W_oᵀ = Q_b·R_b, so M = Q_a·(R_a·R_bᵀ)·Q_bᵀ and the SVD
    of the small R_a·R_bᵀ gives M's (a head's D × D instead of E × E)."""
    qa, ra = torch.linalg.qr(w_v)  # (E, r), (r, D)
    qb, rb = torch.linalg.qr(w_o.t())  # (E, r), (r, D)
    u, s, vh = torch.linalg.svd(ra @ rb.t())  # (r, r) each
    return qa @ u, s, vh @ qb.t()


def low_rank(base: GPT, tr: Trace, layer: int, head: int) -> dict[str, Any]:
    """The note's low-rank view of one head: W_v^i·W_o^i (E, E) has rank <= D. Its
    singular values s_1..s_D, and for r = 0..D the relative error of keeping r of them,
    of the matrix (‖M − M_r‖_F / ‖M‖_F = √(Σ_{j>r} s_j²) / √(Σ s_j²), Eckart–Young) and
    of the head's contribution A·(x·M_r + b_v·W_o^i) on this prompt."""
    w_v, w_o, b_v = head_weights(base, layer, head)
    u, s, vh = _factored_svd(w_v.double(), w_o.double())
    D = s.shape[0]  # the rank bound: D, or E if a head is wider than the stream
    total = float((s ** 2).sum())
    p = f"layer{layer}.head{head}."
    x, a, contrib = tr[f"layer{layer}.ln1"].double(), tr[p + "attn"].double(), \
        tr[p + "contrib"].double()
    norm = float(contrib.norm()) or 1.0
    tail = torch.cat([(s ** 2).flip(0).cumsum(0).flip(0), s.new_zeros(1)])  # Σ_{j>=r} s_j²
    weight_err = (tail / total).clamp(min=0).sqrt().tolist() if total else [0.0] * (D + 1)
    # A·(x·M_r + b_v·W_o^i) = A·b_v·W_o^i + Σ_{j<=r} (A·x·u_j)·s_j·v_jᵀ, for every r at once
    parts = ((a @ (x @ u)) * s)[:, :, None] * vh[None]  # (C, D, E)
    partial = torch.cat([parts.new_zeros(parts.shape[0], 1, parts.shape[2]),
                         parts.cumsum(1)], 1)  # (C, D + 1, E)
    fixed = torch.zeros_like(contrib)  # A·b_v·W_o^i: the bias's share, kept at every r
    if b_v is not None:
        fixed = a @ (b_v.double() @ w_o.double()).expand(a.shape[1], -1)
    out_err = ((partial + fixed[:, None] - contrib[:, None]).norm(dim=(0, 2)) / norm).tolist()
    return {"singular": [float(v) for v in s], "weight_error": weight_err,
            "output_error": out_err}


def _check_choice(name: str, value: Any, count: int, flag: str) -> None:
    if not is_int(value) or not 0 <= value < count:
        raise ConfigError(f"{name} {value!r} is out of range: this model has {count} "
                          f"{name}s (0..{count - 1}); pass {flag} between 0 and {count - 1}")


def _layer_names(tr: Trace, cfg: Any, l: int) -> list[str]:
    """The names of layer l's step-by-step tensors a page carries (those the model has)."""
    n_rep = cfg.n_head // cfg.n_kv_head
    names = [f"layer{l}.{n}" for n in _LAYER_VALUES]
    for i in range(cfg.n_head):
        names += [f"layer{l}.head{i}.{n}" for n in _HEAD_VALUES]
        if i % n_rep == 0:  # the first query head of a group names its key/value head
            names += [f"layer{l}.head{i}.{n}" for n in _KV_VALUES]
    return [n for n in names if n in tr]


def detail_layers(tr: Trace, cfg: Any, layer: int, max_bytes: int = DETAIL_BYTES
                  ) -> list[int]:
    """The layers whose step-by-step tensors fit ``max_bytes`` of base64: all of them, or
    ``layer`` and its nearest neighbours (at least ``layer`` itself)."""
    size = 4 * 4 / 3 * sum(tr[n].numel() for n in _layer_names(tr, cfg, layer))
    count = max(1, min(cfg.n_layer, int(max_bytes // max(size, 1.0))))
    start = max(0, min(layer - (count - 1) // 2, cfg.n_layer - count))
    return list(range(start, start + count))


def _norm_stats(base: GPT, tr: Trace, l: int) -> dict[str, Any]:
    """What layer l's first norm does to each row (token) of the residual stream h:
    h's mean and RMS, the normalised row n (LayerNorm: (h − mean)/std, RMSNorm: h/RMS)
    whose RMS is 1, then x = n·g (+ b) with the learned gain g (E,)."""
    norm = base.blocks[l].ln1
    h, x = tr[f"layer{l}.resid_pre"].double(), tr[f"layer{l}.ln1"].double()
    eps = float(norm.eps)
    if isinstance(norm, nn.LayerNorm):
        n = (h - h.mean(-1, keepdim=True)) / (h.var(-1, unbiased=False, keepdim=True)
                                              + eps).sqrt()
    else:
        n = h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    g = norm.weight.detach().double().cpu()

    def r(v: Any) -> float:  # 7 significant digits, as float32 carries
        return float(f"{float(v):.7g}")

    def rms(t: Tensor) -> list[float]:
        return [r(v) for v in t.pow(2).mean(-1).sqrt()]

    return {"kind": "rmsnorm" if not isinstance(norm, nn.LayerNorm) else "layernorm",
            "h_mean": [r(v) for v in h.mean(-1)], "h_rms": rms(h), "n_rms": rms(n),
            "x_rms": rms(x), "g_rms": r(g.pow(2).mean().sqrt()), "g_mean": r(g.mean()),
            "x_var": r(x.var(unbiased=False)), "h_var": r(h.var(unbiased=False))}


def layer_data(base: GPT, tr: Trace, layers: Sequence[int]) -> dict[str, Any]:
    """The step-by-step tensors of ``layers`` and what their norms did: the part of a
    page that :func:`explorer_data` bounds, and ``POST /v1/explore`` with ``layers``
    answers alone (the live page fetching a layer it does not have)."""
    cfg = base.config
    for l in layers:
        _check_choice("layer", l, cfg.n_layer, "--layer")
    tensors = {n: encode_tensor(tr[n]) for l in layers for n in _layer_names(tr, cfg, l)}
    return {"detail": sorted(set(layers)), "tensors": tensors,
            "norms": {str(l): _norm_stats(base, tr, l) for l in layers}}


def architecture(cfg: Any) -> dict[str, Any]:
    """The parts the page names: norm, positions, FFN, heads and their sharing, the head."""
    return {"norm": cfg.norm, "position": cfg.position, "rope_theta": cfg.rope_theta,
            "mlp": cfg.mlp, "qk_norm": cfg.qk_norm, "n_kv_head": cfg.n_kv_head,
            "tied": cfg.tie_embeddings, "bias": cfg.bias, "qkv_bias": cfg.qkv_bias}


@dataclass(frozen=True)
class RequestCost:
    """What one explore or explain request will cost, estimated from the model's shape
    before any work starts: ``bytes`` of peak memory (an upper estimate: the trace, the
    largest working set, the answer and its JSON text) and ``forward_passes`` (full
    forwards; an ablation from layer l counts as a whole one)."""

    bytes: int
    forward_passes: int


_F32 = 4
#: Bytes of one [id, prob] pair of a top-k table once in Python lists and in JSON text.
_PAIR_BYTES = 160


def _trace_bytes(cfg: Any, C: int) -> int:
    """The values :func:`~tinylm.use.inspection.trace` keeps (fp32): per layer its (C, E),
    (C, H·D) and (C, F) steps, per head its (C, D) and (C, E) steps and four (C, C) maps;
    the logits and the reference forward's (C, V)."""
    L, H, D, E, F_ = cfg.n_layer, cfg.n_head, cfg.head_dim, cfg.n_embd, cfg.ffn_dim
    per_layer = 9 * E + H * D + 3 * F_ + H * (8 * D + E + 4 * C)
    return _F32 * C * (L * per_layer + 4 * E + 2 * cfg.vocab_size)


def _work_bytes(cfg: Any, C: int) -> int:
    """The largest temporary working set after the trace: one batched ablation pass (its
    rows' logits, one row's softmax, the rows' activations and maps), the logit lens, or
    one head's low-rank errors (float64, (C, D + 1, E) three times)."""
    H, D, E, F_, V = cfg.n_head, cfg.head_dim, cfg.n_embd, cfg.ffn_dim, cfg.vocab_size
    rows = ablation_rows_per_pass(C, V)
    ablation = _F32 * C * (rows * (V + 6 * E + 3 * F_ + 3 * H * D + 2 * H * C) + V)
    lens = _F32 * C * V * 2
    low_rank = 8 * C * (min(D, E) + 1) * E * 3
    checks = _F32 * C * V // 2  # isfinite's bool masks, the allocator's slack
    return max(ablation, lens, low_rank) + checks


def explore_cost(config: Any, n_tokens: int, *, top_k: int = 5,
                 layers: int | None = None, max_bytes: int = DETAIL_BYTES) -> RequestCost:
    """The cost of :func:`explorer_data` on ``n_tokens`` tokens with ``config``'s shape
    (``layers``: of :func:`explorer_layers` for that many layers instead), for a server to
    decide before starting: every head's attention maps and the step-by-step tensors in
    base64 (twice: the answer and its JSON text), the ablation tables (layers × (heads +
    2) keys × C × top_k pairs), the trace and the largest working set."""
    cfg, C = config, int(n_tokens)
    L, H = cfg.n_layer, cfg.n_head
    b64 = _F32 * 4 // 3 + 1
    if layers is None:
        keys, tables = L * (H + 2), L * (H + 2) + 2 * (L + 1)
        encoded = b64 * L * H * C * C + max_bytes + b64 * L * H * (cfg.head_dim + 1) * 3
    else:
        keys = tables = int(layers) * H
        encoded = max_bytes * max(1, int(layers))
    answer = 2 * encoded + tables * C * top_k * _PAIR_BYTES
    total = _trace_bytes(cfg, C) + _work_bytes(cfg, C) + answer
    return RequestCost(bytes=int(total), forward_passes=2 + keys)


def explain_cost(config: Any, n_tokens: int, *, top_k: int = 5) -> RequestCost:
    """The cost of :func:`~tinylm.use.inspection.explain` (``POST /v1/explain``,
    ``tinylm explain`` without ``--html``): one forward through the explicit path, its
    logits (C, V) and softmax, every attention map (L, H, C, C) with its scores, the
    activations, and the table of C × top_k candidates."""
    cfg, C = config, int(n_tokens)
    L, H, E = cfg.n_layer, cfg.n_head, cfg.n_embd
    maps = 3 * L * H * C * C  # scores, weights, and the (L, H, C, C) copy returned
    activations = C * (8 * E + 3 * cfg.ffn_dim + 3 * H * cfg.head_dim)
    total = _F32 * (3 * C * cfg.vocab_size + maps + activations) + C * top_k * _PAIR_BYTES
    return RequestCost(bytes=int(total), forward_passes=1)


def explorer_data(model: nn.Module, tokenizer: Any, prompt: str | Sequence[int], *,
                  top_k: int = 5, layer: int = 0, head: int = 0,
                  max_bytes: int = DETAIL_BYTES) -> dict[str, Any]:
    """Everything the explorer page shows for ``prompt``, as one JSON-ready dict (the
    page's static data, and the body ``POST /v1/explore`` answers with). ``layer`` and
    ``head`` are the ones the page opens on. Every layer's attention maps, logit lens,
    ablations and low-rank spectra are in it; the step-by-step tensors of the layers
    that fit ``max_bytes`` (:func:`detail_layers`: all of a small model's), and the
    ablations of their single heads (every layer's attention and FFN ablations)."""
    base = check_traceable(model)
    cfg = base.config
    _check_choice("layer", layer, cfg.n_layer, "--layer")
    _check_choice("head", head, cfg.n_head, "--head")
    if not is_int(top_k) or not 1 <= top_k <= 50:
        raise ConfigError(f"top-k must be an integer in 1..50, got {top_k!r}; use --top-k 5")
    ids = encode_prompt(tokenizer, prompt, cfg.context_length)
    if max(ids) >= cfg.vocab_size:
        raise DataError(f"token id {max(ids)} is outside the model's vocabulary of "
                        f"{cfg.vocab_size}; the tokenizer does not belong to this model")
    tr = trace(base, ids)
    nxt = _top(tr["logits"], top_k)
    detail = detail_layers(tr, cfg, layer, max_bytes)
    data = {
        "format": FORMAT, "prompt": prompt if isinstance(prompt, str) else None,
        "ids": ids, "tokens": [token_text(tokenizer, i) for i in ids],
        "sizes": {**tr.sizes, "Hkv": cfg.n_kv_head}, "arch": architecture(cfg),
        "select": {"layer": layer, "head": head},
        **layer_data(base, tr, detail),
        "next": nxt, "lens": _logit_lens(base, tr, top_k),
        "ablations": _ablations(base, tr, [row[0][0] for row in nxt], top_k, detail),
        "lowrank": {f"layer{l}.head{i}": low_rank(base, tr, l, i)
                    for l in range(cfg.n_layer) for i in range(cfg.n_head)},
    }
    for l in range(cfg.n_layer):  # the maps of every layer (the Maps view shows them all)
        for i in range(cfg.n_head):
            data["tensors"][f"layer{l}.head{i}.attn"] = encode_tensor(tr[f"layer{l}.head{i}.attn"])
    used = set(ids) | {c[0] for rows in [nxt] + [s["top"] for s in data["lens"]]
                              + [a["top"] for a in data["ablations"]] for row in rows
                              for c in row}
    data["vocab"] = {str(i): token_text(tokenizer, i) for i in sorted(used)}
    return data


def explorer_layers(model: nn.Module, tokenizer: Any, prompt: str | Sequence[int],
                    layers: Any, *, top_k: int = 5) -> dict[str, Any]:
    """Only the step-by-step part (:func:`layer_data`) of ``layers`` for ``prompt`` and
    the ablations of their heads: what the live page asks ``POST /v1/explore`` for
    (``{"prompt", "top_k", "layers"}``) when it opens a layer it does not carry."""
    base = check_traceable(model)
    cfg = base.config
    if not isinstance(layers, (list, tuple)) or not 1 <= len(layers) <= cfg.n_layer:
        raise ConfigError(f"layers must be a list of 1 to {cfg.n_layer} layer numbers, got "
                          f"{layers!r}")
    if not is_int(top_k) or not 1 <= top_k <= 50:
        raise ConfigError(f"top-k must be an integer in 1..50, got {top_k!r}; use --top-k 5")
    ids = encode_prompt(tokenizer, prompt, cfg.context_length)
    for l in layers:
        _check_choice("layer", l, cfg.n_layer, "layers")
    tr = trace(base, ids)
    top = [row[0][0] for row in _top(tr["logits"], 1)]
    ablations = _ablations(base, tr, top, top_k, list(layers), whole_layers=False)
    used = {c[0] for a in ablations for row in a["top"] for c in row}
    return {"format": FORMAT, "ids": ids, **layer_data(base, tr, list(layers)),
            "ablations": ablations,
            "vocab": {str(i): token_text(tokenizer, i) for i in sorted(used)}}


def _asset(name: str) -> str:
    return resources.files("tinylm.use").joinpath("explorer_page", name).read_text(encoding="utf-8")


#: What :func:`_script_json` writes as a JSON escape: "<" and ">" (no "</script>", no
#: "<!--" that would send the HTML parser into a script's escaped states), "&", and the
#: line separators U+2028/9.
_SCRIPT_ESCAPES = {"<": "\\u003c", ">": "\\u003e", "&": "\\u0026", "\u2028": "\\u2028",
                   "\u2029": "\\u2029"}


def _script_json(value: Any) -> str:
    """JSON safe inside <script>: no "<", ">" or "&" (each written as its \\u escape, which
    JSON.parse reads back as the same character), so nothing in it can end the block or
    change how the HTML parser reads it."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return re.sub("[<>&\u2028\u2029]", lambda m: _SCRIPT_ESCAPES[m.group(0)], text)


def render_explorer(data: dict[str, Any] | None, *, title: str = "tinylm explorer",
                    endpoint: str | None = None) -> str:
    """The explorer page. Static: ``data`` from :func:`explorer_data` is embedded and the
    page references no URL of any kind. Live: with ``endpoint`` (e.g. ``/v1/explore``)
    the page also shows a prompt box and POSTs ``{"prompt", "top_k"}`` there; ``data``
    may then be None until the first answer."""
    if data is None and endpoint is None:
        raise ConfigError("a static explorer page needs its data; pass explorer_data(...)")
    config = {"title": title, "endpoint": endpoint}
    parts = {"title": html.escape(title), "css": _asset("explorer.css"),
             "config": _script_json(config), "data": _script_json(data),
             "js": _asset("explorer.js")}
    # One pass over the template: a "{{js}}" inside the data is data, not a placeholder.
    return re.sub(r"\{\{(title|css|config|data|js)\}\}", lambda m: parts[m.group(1)],
                  _asset("explorer.html"))


def write_explorer(data: dict[str, Any], path: str | os.PathLike, *,
                   title: str = "tinylm explorer") -> Path:
    """Write the static page to ``path`` (atomically: :func:`tinylm.io.files.atomic_write_with`)."""
    out = Path(path)
    page = render_explorer(data, title=title)
    if out.is_dir():
        raise ConfigError(f"cannot write the page to {out}: it is a folder; pass a file "
                          f"name such as {out / 'explorer.html'}")
    atomic_write_with(out, lambda tmp: Path(tmp).write_text(page, encoding="utf-8"))
    return out


@dataclass(frozen=True)
class ExplainReport:
    """What ``tinylm explain`` computed and wrote: the table (or None without a prompt),
    the neighbours (or None) and the files written, in order."""

    explanation: Explanation | None
    neighbours: list[Neighbour] | None
    written: tuple[Path, ...]


def run_explain(model_dir: str | os.PathLike, *, prompt: str | None = None, top_k: int = 5,
                attention: str | None = None, html_path: str | None = None, layer: int = 0,
                head: int = 0, neighbours: str | None = None, count: int = 10,
                device: str = "cpu") -> ExplainReport:
    """``tinylm explain``: every check first (flags, picture format, model, prompt, layer
    and head), then the computing, then the writing — bad input writes nothing."""
    if prompt is None and neighbours is None:
        raise ConfigError("nothing to explain; pass --prompt TEXT and/or --neighbours TOKEN")
    if prompt is None and (attention or html_path):
        raise ConfigError("--attention and --html draw the maps of a prompt; pass --prompt TEXT")
    if attention:
        picture_format(attention)
    if html_path and Path(html_path).is_dir():
        raise ConfigError(f"cannot write the page to {html_path}: it is a folder; pass a "
                          f"file name such as {Path(html_path) / 'explorer.html'}")
    model, tokenizer = load_checkpoint(model_dir, resolve_device(device))
    if tokenizer is None:  # the one "has no tokenizer.json" error
        require_tokenizer_of(model_dir, "explain needs the model's tokenizer to show tokens")
    cfg = check_traceable(model).config if html_path else unwrap_model(model).config
    _check_choice("layer", layer, cfg.n_layer, "--layer")
    _check_choice("head", head, cfg.n_head, "--head")
    explanation = data = near = None
    if prompt is not None:
        explanation = explain(model, tokenizer, prompt, top_k=top_k)
        if html_path:
            data = explorer_data(model, tokenizer, prompt, top_k=min(top_k, 50), layer=layer,
                                 head=head)
    if neighbours is not None:
        near = nearest_tokens(model, tokenizer, neighbours, count)
    written = []
    if attention:
        written.append(plot_attention(explanation, attention))
    if data is not None:
        written.append(write_explorer(data, html_path))
    return ExplainReport(explanation, near, tuple(written))


__all__ = [
    "FORMAT",
    "ExplainReport",
    "RequestCost",
    "decode_tensor",
    "encode_tensor",
    "DETAIL_BYTES",
    "architecture",
    "detail_layers",
    "explain_cost",
    "explore_cost",
    "explorer_data",
    "explorer_layers",
    "head_weights",
    "layer_data",
    "low_rank",
    "render_explorer",
    "run_explain",
    "write_explorer",
]
