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
from tinylm.io.checkpoint import load_checkpoint, require_tokenizer_of, unwrap_model
from tinylm.io.files import atomic_write_with
from tinylm.use.inspection import (
    Explanation,
    Neighbour,
    Trace,
    ablated_logits,
    ablation_keys,
    check_traceable,
    encode_prompt,
    explain,
    nearest_tokens,
    picture_format,
    plot_attention,
    token_text,
    trace,
)

log = logging.getLogger(__name__)

FORMAT = 1  # the version of explorer_data's layout, read by the page
_HEAD_VALUES = ("q", "k", "v", "scores", "attn", "out", "contrib")
_LAYER_VALUES = ("ln1", "attn_out", "attn_concat")


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
    probs = F.softmax(logits.float(), dim=-1)
    top = torch.topk(probs, min(k, probs.shape[-1]), dim=-1)
    return [[[int(i), round(float(p), 6)] for p, i in zip(vals, idx, strict=True)]
            for vals, idx in zip(top.values.tolist(), top.indices.tolist(), strict=True)]


def _logit_lens(base: GPT, tr: Trace, k: int) -> list[dict[str, Any]]:
    """The top-k next tokens read out of the residual stream after the embedding and
    after each layer: softmax(lm_head(final_norm(x))) — the last equals the output."""
    stages = [("embedding", "embed")] + [(f"after layer {l}", f"layer{l}.resid_post")
                                         for l in range(tr.sizes["L"])]
    dev = next(base.parameters()).device
    out = []
    with torch.inference_mode():
        for label, name in stages:
            x = tr[name].to(dev, next(base.parameters()).dtype)
            out.append({"label": label, "name": name,
                        "top": _top(base.lm_head(base.final_norm(x)).cpu(), k)})
    return out


def _ablations(base: GPT, ids: list[int], base_top: list[int], k: int) -> list[dict[str, Any]]:
    """For every single ablation key, the next-token table with that part switched off
    and the probability it leaves to each position's original top token."""
    keys = ablation_keys(base.config.n_layer, base.config.n_head)
    logits = ablated_logits(base, ids, keys)  # (K, C, V)
    probs = F.softmax(logits, dim=-1)
    pos = torch.arange(len(ids))
    return [{"key": key, "top": _top(logits[b], k),
             "orig_top_prob": [round(float(p), 6) for p in probs[b, pos, base_top]]}
            for b, key in enumerate(keys)]


def head_weights(base: GPT, layer: int, head: int) -> tuple[Tensor, Tensor, Tensor | None]:
    """W_v^i (E, D), W_o^i (D, E) in the note's x·W orientation, and b_v^i (D,) or None."""
    attn = base.blocks[layer].attn
    H, D = attn.n_head, attn.head_dim
    rows = slice(2 * H * D + head * D, 2 * H * D + (head + 1) * D)
    w_v = attn.qkv.weight.detach()[rows].t()  # (E, D)
    w_o = attn.out.weight.detach()[:, head * D:(head + 1) * D].t()  # (D, E)
    b = attn.qkv.bias
    return w_v.float().cpu(), w_o.float().cpu(), None if b is None else b.detach()[rows].float()


def low_rank(base: GPT, tr: Trace, layer: int, head: int) -> dict[str, Any]:
    """The note's low-rank view of one head: W_v^i·W_o^i (E, E) has rank <= D. Its
    singular values s_1..s_D, and for r = 0..D the relative error of keeping r of them,
    of the matrix (‖M − M_r‖_F / ‖M‖_F = √(Σ_{j>r} s_j²) / √(Σ s_j²), Eckart–Young) and
    of the head's contribution A·(x·M_r + b_v·W_o^i) on this prompt."""
    w_v, w_o, b_v = head_weights(base, layer, head)
    m = w_v.double() @ w_o.double()  # (E, D)·(D, E) -> (E, E)
    u, s, vh = torch.linalg.svd(m)
    D = min(w_v.shape)  # the rank bound: D, or E if a head is wider than the stream
    s = s[:D]
    total = float((s ** 2).sum())
    p = f"layer{layer}.head{head}."
    x, a, contrib = tr[f"layer{layer}.ln1"].double(), tr[p + "attn"].double(), \
        tr[p + "contrib"].double()
    norm = float(contrib.norm()) or 1.0
    tail = torch.cat([(s ** 2).flip(0).cumsum(0).flip(0), s.new_zeros(1)])  # Σ_{j>=r} s_j²
    weight_err = (tail / total).clamp(min=0).sqrt().tolist() if total else [0.0] * (D + 1)
    # A·(x·M_r + b_v·W_o^i) = A·b_v·W_o^i + Σ_{j<=r} (A·x·u_j)·s_j·v_jᵀ, for every r at once
    parts = ((a @ (x @ u[:, :D])) * s)[:, :, None] * vh[:D][None]  # (C, D, E)
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


def explorer_data(model: nn.Module, tokenizer: Any, prompt: str | Sequence[int], *,
                  top_k: int = 5, layer: int = 0, head: int = 0) -> dict[str, Any]:
    """Everything the explorer page shows for ``prompt``, as one JSON-ready dict (the
    page's static data, and the body ``POST /v1/explore`` answers with). ``layer`` and
    ``head`` are the ones the page opens on."""
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
    tensors = {}
    for l in range(cfg.n_layer):
        for name in _LAYER_VALUES:
            tensors[f"layer{l}.{name}"] = encode_tensor(tr[f"layer{l}.{name}"])
        for i in range(cfg.n_head):
            for name in _HEAD_VALUES:
                key = f"layer{l}.head{i}.{name}"
                tensors[key] = encode_tensor(tr[key])
    nxt = _top(tr["logits"], top_k)
    data = {
        "format": FORMAT, "prompt": prompt if isinstance(prompt, str) else None,
        "ids": ids, "tokens": [token_text(tokenizer, i) for i in ids],
        "sizes": tr.sizes, "select": {"layer": layer, "head": head},
        "tensors": tensors, "next": nxt, "lens": _logit_lens(base, tr, top_k),
        "ablations": _ablations(base, ids, [row[0][0] for row in nxt], top_k),
        "lowrank": {f"layer{l}.head{i}": low_rank(base, tr, l, i)
                    for l in range(cfg.n_layer) for i in range(cfg.n_head)},
    }
    used = set(ids) | {c[0] for rows in [nxt] + [s["top"] for s in data["lens"]]
                              + [a["top"] for a in data["ablations"]] for row in rows
                              for c in row}
    data["vocab"] = {str(i): token_text(tokenizer, i) for i in sorted(used)}
    return data


def _asset(name: str) -> str:
    return resources.files("tinylm.use").joinpath("explorer_page", name).read_text(encoding="utf-8")


def _script_json(value: Any) -> str:
    """JSON safe inside <script>: "</" cannot end the block, and no U+2028/9 surprises."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    return text.replace("</", "<\\/").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


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
    "decode_tensor",
    "encode_tensor",
    "explorer_data",
    "head_weights",
    "low_rank",
    "render_explorer",
    "run_explain",
    "write_explorer",
]
