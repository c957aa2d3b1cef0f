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

import html
import json
import logging
import os
import unicodedata
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.errors import ConfigError, DataError

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
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ConfigError(f"top-k must be an integer >= 1, got {top_k!r}; use --top-k 5")


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
    from tinylm.checkpoint import unwrap_model

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
    probs = F.softmax(logits[0].float(), dim=-1).cpu()  # (C, V)
    attention = maps[:, 0].float().cpu()  # (L, 1, H, C, C) -> (L, H, C, C)
    rows = next_token_rows(probs, ids, tokenizer, top_k)
    return Explanation(tuple(ids), tuple(r.token for r in rows), rows, probs, attention)


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
    from tinylm.checkpoint import unwrap_model

    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"count must be an integer >= 1, got {count!r}; use --count 10")
    base = unwrap_model(model)
    query = token_id_of(tokenizer, token)
    with torch.inference_mode():
        emb = base.tok_emb.weight.detach().float().cpu()  # (V, E)
        if query >= emb.shape[0]:
            raise DataError(f"token {token!r} has id {query}, outside the model's vocabulary "
                            f"of {emb.shape[0]}; the tokenizer does not belong to this model")
        sims = F.cosine_similarity(emb, emb[query][None, :], dim=-1)  # (V, E) vs (1, E) -> (V,)
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


def plot_attention(explanation: Explanation, path: str | os.PathLike, *,
                   max_labels: int = 48) -> Path:
    """Draw every attention map as a grid (layers × heads) of heatmaps and save a PNG.

    Cell (l, h) shows layer l, head h: row i = query token i, column j = key token j,
    colour = weight; the masked upper triangle is left blank. Axes are labelled with the
    tokens when there are at most ``max_labels`` of them.
    """
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
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fig.savefig(out, format="png", dpi=110)
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}; choose a writable path") from exc
    missing = {str(w.message) for w in caught if "missing from font" in str(w.message)}
    if missing:
        log.info("%d character(s) in the token labels have no glyph in matplotlib's font and "
                 "show as boxes in %s", len(missing), out)
    for w in caught:
        if "missing from font" not in str(w.message):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out


# --- rendering: HTML --------------------------------------------------------------------

_CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;background:#fafafa}
h1{font-size:1.2em}.controls{margin:.8em 0}.controls label{margin-right:1em}
#tokens{line-height:2.4em;margin:1em 0;font-family:monospace;font-size:1.05em}
.tok{padding:.2em .35em;margin:0 .1em;border:1px solid #ccc;border-radius:4px;cursor:pointer;
white-space:pre}.tok.sel{outline:2px solid #d33}
.wrap{display:flex;gap:2em;flex-wrap:wrap;align-items:flex-start}
canvas{border:1px solid #ccc;image-rendering:pixelated;background:#fff}
table{border-collapse:collapse;font-family:monospace}td,th{padding:.15em .6em;text-align:left}
th{border-bottom:1px solid #999}.bar{display:inline-block;height:.8em;background:#4a7}
.note{color:#666;font-size:.9em}
"""

_JS = """
(function(){
var D=JSON.parse(document.getElementById('data').textContent);
var L=D.layers,H=D.heads,C=D.tokens.length;
var ls=document.getElementById('layer'),hs=document.getElementById('head');
for(var l=0;l<L;l++){ls.add(new Option('layer '+l,l));}
hs.add(new Option('mean of heads',-1));
for(var h=0;h<H;h++){hs.add(new Option('head '+h,h));}
hs.value=0;
var cur=C-1,box=document.getElementById('tokens');
function vis(t){return t.replace(/ /g,'\\u2423').replace(/\\n/g,'\\\\n').replace(/\\t/g,'\\\\t');}
function row(l,h,i){
 if(h>=0){return D.attn[l][h][i];}
 var r=[];for(var j=0;j<=i;j++){var s=0;for(var k=0;k<H;k++){s+=D.attn[l][k][i][j];}r.push(s/H);}
 return r;}
var spans=[];
D.tokens.forEach(function(t,i){var s=document.createElement('span');s.className='tok';
 s.textContent=vis(t);s.title='position '+i+', id '+D.ids[i];
 s.onmouseenter=function(){cur=i;draw();};box.appendChild(s);spans.push(s);});
function cell(w){var v=Math.round(255*(1-w));return 'rgb('+v+','+(v+Math.round(40*w))+',255)';}
function draw(){
 var l=+ls.value,h=+hs.value,r=row(l,h,cur);
 spans.forEach(function(s,j){s.classList.toggle('sel',j===cur);
  s.style.background=j<=cur?cell(r[j]):'#eee';});
 var rows='<tr><th>key token</th><th>weight</th><th></th></tr>';
 var order=r.map(function(w,j){return [w,j];}).sort(function(a,b){return b[0]-a[0];});
 order.slice(0,10).forEach(function(p){rows+='<tr><td>'+esc(vis(D.tokens[p[1]]))+
  ' <span class=note>@'+p[1]+'</span></td><td>'+p[0].toFixed(3)+
  '</td><td><span class=bar style="width:'+Math.round(120*p[0])+'px"></span></td></tr>';});
 document.getElementById('weights').innerHTML=rows;
 document.getElementById('wtitle').textContent='attention of '+vis(D.tokens[cur])+
  ' (position '+cur+') in layer '+l+', '+(h<0?'mean of heads':'head '+h);
 var c=D.candidates[cur],crows='<tr><th>next token</th><th>prob</th><th></th></tr>';
 c.forEach(function(x){crows+='<tr><td>'+esc(vis(x.token))+'</td><td>'+x.prob.toFixed(3)+
  '</td><td><span class=bar style="width:'+Math.round(120*x.prob)+'px"></span></td></tr>';});
 document.getElementById('cands').innerHTML=crows;
 document.getElementById('ctitle').textContent='after "'+
  vis(D.tokens.slice(0,cur+1).join(''))+'"';
 heat(l,h);}
function esc(s){return s.replace(/&/g,'&amp;').replace(/</g,'&lt;').replace(/>/g,'&gt;');}
var cv=document.getElementById('map'),px=Math.max(4,Math.min(24,Math.floor(480/C)));
cv.width=cv.height=px*C;
function heat(l,h){var g=cv.getContext('2d');g.clearRect(0,0,cv.width,cv.height);
 for(var i=0;i<C;i++){var r=row(l,h,i);for(var j=0;j<=i;j++){g.fillStyle=cell(r[j]);
  g.fillRect(j*px,i*px,px,px);}}
 g.strokeStyle='#d33';g.strokeRect(0,cur*px+.5,px*(cur+1),px-1);}
cv.onmousemove=function(e){var b=cv.getBoundingClientRect();
 var i=Math.floor((e.clientY-b.top)/px);if(i>=0&&i<C&&i!==cur){cur=i;draw();}};
ls.onchange=hs.onchange=draw;draw();})();
"""


def _html_data(explanation: Explanation, digits: int = 4) -> dict[str, Any]:
    maps = explanation.attention  # (L, H, C, C)
    L, H, C, _ = maps.shape
    # Only the lower triangle is stored: row i holds the weights of keys 0..i.
    attn = [[[[round(w, digits) for w in maps[layer, head, i, :i + 1].tolist()]
              for i in range(C)] for head in range(H)] for layer in range(L)]
    return {
        "layers": L, "heads": H, "tokens": list(explanation.tokens),
        "ids": list(explanation.ids), "attn": attn,
        "candidates": [[{"token": c.token, "id": c.id, "prob": round(c.prob, digits)}
                        for c in r.candidates] for r in explanation.rows],
    }


def render_html(explanation: Explanation, *, title: str = "tinylm explain") -> str:
    """One self-contained offline page: pick a layer and head, hover a token (or a row of
    the heatmap) to see its attention weights and the next-token candidates.

    CSS, JavaScript and data are inline; the page references no URL of any kind.
    """
    L, H, C, _ = explanation.attention.shape
    if L * H * C * (C + 1) // 2 > 5_000_000:
        log.warning("the page holds %d attention weights (%d layers × %d heads × %d tokens); "
                    "it may be slow to open; a shorter prompt keeps it small",
                    L * H * C * (C + 1) // 2, L, H, C)
    data = json.dumps(_html_data(explanation), ensure_ascii=False, separators=(",", ":"))
    data = data.replace("</", "<\\/")  # a token "</script>" must not end the data block
    prompt = html.escape("".join(explanation.tokens))
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>\n"
        f"<h1>{html.escape(title)}</h1><p class=note>prompt: <code>{prompt}</code> — "
        "hover a token (or a row of the map) to see where it attends and which token "
        "the model expects next.</p>\n"
        "<div class=controls><label>layer <select id=layer></select></label>"
        "<label>head <select id=head></select></label></div>\n"
        "<div id=tokens></div>\n<div class=wrap><div><h3>attention map</h3>"
        "<canvas id=map></canvas><p class=note>row = query token, column = key token; "
        "darker = more weight</p></div>\n"
        "<div><h3 id=wtitle></h3><table id=weights></table></div>\n"
        "<div><h3>next-token candidates</h3><p class=note id=ctitle></p>"
        "<table id=cands></table></div></div>\n"
        f"<script type=\"application/json\" id=data>{data}</script>\n"
        f"<script>{_JS}</script>\n</body></html>\n"
    )


def write_html(explanation: Explanation, path: str | os.PathLike, *,
               title: str = "tinylm explain") -> Path:
    """Write :func:`render_html`'s page to ``path``."""
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(render_html(explanation, title=title), encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot write {out}: {exc.strerror}; choose a writable path") from exc
    return out


__all__ = [
    "Candidate",
    "Explanation",
    "Neighbour",
    "Row",
    "display_token",
    "encode_prompt",
    "explain",
    "format_neighbours",
    "format_table",
    "nearest_tokens",
    "next_token_rows",
    "plot_attention",
    "render_html",
    "token_id_of",
    "token_text",
    "write_html",
]
