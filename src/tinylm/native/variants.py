"""The fused training block for the architecture variants (docs/architectures.md):
:class:`VariantBlockFn`, one autograd step per block, as :class:`~tinylm.native.functions.BlockFn`
is for GPT-2's layout.

It computes the reference :class:`~tinylm.core.model.Block` with any of the layouts
``ModelConfig`` offers: LayerNorm or RMSNorm, learned or rotary positions, QK-norm,
grouped-query attention (each key/value head repeated for the query heads it serves,
its gradient summed back), GELU / ReLU² / SwiGLU MLPs, with or without biases. Per block:

    a = Norm1(x);  qkv = a·W_qkvᵀ (+ b);  q, k ← RoPE(QKNorm(q, k))
    x1 = x + Attention(q, k, v)·W_oᵀ (+ b_o)
    y  = x1 + MLP(Norm2(x1))

The attention runs on the native kernel (``Library.causal_attention``: the heads read in
place from one (B, C, 3·H·D) buffer, one log-sum-exp kept per query); LayerNorm, RMSNorm,
QK-norm with the rotation and the grouped-query repeat (one pass from qkv to the kernel's
input), GELU and ReLU² on native kernels with their backward written out
(csrc/variants.c, csrc/layernorm.c, csrc/gelu.c); the GEMMs and SwiGLU's few passes in
torch; instead of a graph of dozens of small autograd steps per block. What is kept for
backward is what those steps need: the norms' inputs and statistics, qkv before and after
QK-norm/RoPE, the heads' outputs, the MLP's pre-activations; activations are recomputed
from them. Applied by
:class:`tinylm.native.plan.NativeVariantBlock`; tests/test_variant_block.py holds its
outputs and every gradient to the reference modules'.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from tinylm.core.attention import rope_angles
from tinylm.native import gemm
from tinylm.native.functions import Scratch, gelu_backward
from tinylm.native.ops import Library

#: ``buf(name, shape) -> Tensor``: where :func:`block_forward` puts a large temporary.
Buffers = Callable[[str, tuple[int, ...]], Tensor]


def fresh(name: str, shape: tuple[int, ...]) -> Tensor:
    """A new tensor for each temporary (training: backward keeps them)."""
    return torch.empty(shape)

#: The tensors of one block, in the order :meth:`VariantBlockFn.apply` takes them
#: (after x); a missing one (no bias, no QK-norm, no gate) is None.
TENSORS = ("ln1_w", "ln1_b", "w_qkv", "b_qkv", "q_norm", "k_norm", "w_out", "b_out",
           "ln2_w", "ln2_b", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down",
           "cos", "sin")


@dataclass(frozen=True)
class Layout:
    """What one block computes, beyond its tensors."""

    n_head: int
    n_kv_head: int  # fewer than n_head: grouped-query attention
    norm: str  # "layernorm" | "rmsnorm"
    mlp: str  # "gelu" | "relu2" | "swiglu"
    eps1: float
    eps2: float
    qk_eps: float


# --- the norms ------------------------------------------------------------------------------


def norm_forward(lib: Library, kind: str, x: Tensor, w: Tensor | None, b: Tensor | None,
                 eps: float, out: Tensor | None = None) -> tuple[Tensor, tuple[Tensor, ...]]:
    """(Norm(x) (into ``out`` if given), the statistics backward needs) for x (N, E)."""
    if kind == "layernorm":
        y, mean, rstd = lib.layer_norm(x, w, b, eps, out)
        return y, (mean, rstd)
    y, rs = lib.rms_norm(x, w, eps, out)
    return y, (rs,)


def norm_backward(lib: Library, kind: str, grad_y: Tensor, x: Tensor, w: Tensor | None,
                  stats: tuple[Tensor, ...], need_w: bool, need_b: bool, residual: Tensor
                  ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(dL/dx + ``residual`` (the residual path's gradient, added in the same pass),
    dL/dw, dL/db) of :func:`norm_forward` from dL/dy."""
    if kind == "layernorm":
        mean, rstd = stats
        return lib.layer_norm_backward(grad_y, x, w, mean, rstd, w is not None and need_w,
                                       need_b, residual)
    return lib.rms_norm_backward(grad_y, x, w, stats[0], need_w, residual) + (None,)


# --- QK-norm and the rotation ---------------------------------------------------------------
#
# RoPE's y = x·cos + R(x)·sin with R(x₁, x₂) = (−x₂, x₁) (attention.apply_rope). The two
# halves of cos and sin are equal (rope_angles repeats the D/2 angles), so R(x)·sin =
# S(x)·sin± with S the swap of halves (x₂, x₁) and sin± = (−sin₁, sin₂). Its transpose
# gives dL/dx = dL/dy·cos − S(dL/dy)·sin±. Both, with QK-norm before the rotation and the
# grouped-query repeat of k and v, are one native pass over the rows of qkv
# (Library.qk_rope and qk_rope_backward, csrc/variants.c).


def signed_sin(sin: Tensor) -> Tensor:
    """sin± = (−sin₁, sin₂) of a sin table (…, D) whose halves are equal."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


# --- the MLPs -------------------------------------------------------------------------------


def mlp_forward(lib: Library, kind: str, f_in: Tensor, t: dict[str, Tensor | None],
                buf: Buffers = fresh) -> tuple[Tensor, tuple[Tensor, ...]]:
    """(the MLP's activation g (N, F), the pre-activations backward recomputes it from);
    ``buf`` gives the memory of h and g."""
    N, F_ = f_in.shape[0], t["w_up"].shape[0]
    h = gemm.xwt(f_in, t["w_up"], out=buf("h", (N, F_)))  # (N, E)·(E, F) -> (N, F)
    if kind == "gelu":  # h += b_up; GELU(h)
        return lib.bias_gelu_(h, t["b_up"], buf("g", (N, F_))), (h,)
    if t["b_up"] is not None:
        h += t["b_up"]
    if kind == "relu2":
        return lib.relu2(h, buf("g", (N, F_))), (h,)
    gate = gemm.xwt(f_in, t["w_gate"], out=buf("gate", (N, F_)))
    if t["b_gate"] is not None:
        gate += t["b_gate"]
    return F.silu(gate).mul_(h), (gate, h)  # SwiGLU: SiLU(gate) ⊙ up


def mlp_backward(lib: Library, kind: str, grad_g: Tensor, kept: tuple[Tensor, ...]
                 ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(g recomputed, dL/d(up pre-activation), dL/d(gate pre-activation) or None)."""
    if kind == "gelu":
        grad_h, g, _ = gelu_backward(lib, grad_g, kept[0], False)
        return g, grad_h, None
    if kind == "relu2":
        grad_h, g = lib.relu2_backward(grad_g, kept[0])  # grad_g: this step's own
        return g, grad_h, None
    gate, h = kept
    sig = torch.sigmoid(gate)
    s = gate * sig  # SiLU(gate)
    grad_gate = grad_g * h * sig * (1 + gate * (1 - sig))  # SiLU'(z) = σ(z)(1 + z(1 − σ(z)))
    return s * h, grad_g * s, grad_gate


# --- the block ------------------------------------------------------------------------------


def block_forward(lib: Library, layout: Layout, x: Tensor, t: dict[str, Tensor | None],
                  buf: Buffers = fresh) -> tuple[Tensor, tuple[Tensor | None, ...],
                                                 tuple[tuple[Tensor, ...], ...]]:
    """The block's forward on x (B, C, E) (see the module docstring): (y (B, C, E), the
    intermediates (x0, a_in, qk, rs_qk, att_in, r2, lse, x1, f_in), the statistics of
    both norms and the MLP's kept pre-activations). ``buf(name, shape)`` gives the memory
    of each large temporary: :func:`fresh` in training (backward keeps them), per-thread
    buffers without gradients (:func:`block_inference`). y is always a new tensor."""
    B, C, E = x.shape
    H, N = layout.n_head, B * C
    x0 = x.contiguous().view(N, E)
    a_in, st1 = norm_forward(lib, layout.norm, x0, t["ln1_w"], t["ln1_b"], layout.eps1,
                             buf("a_in", (N, E)))
    qkv = gemm.xwt(a_in, t["w_qkv"], out=buf("qkv", (N, t["w_qkv"].shape[0])))
    qkv = qkv.view(B, C, -1)  # (B, C, 3·H·D), [q | k | v]
    HD = t["w_out"].shape[1]
    qk = rs_qk = None
    if t["q_norm"] is not None or t["cos"] is not None or layout.n_kv_head != H:
        if t["b_qkv"] is not None:
            qkv += t["b_qkv"]
        qk = qkv  # kept: QK-norm's backward needs its input
        att_in, rs_qk = lib.qk_rope(qkv, H, layout.n_kv_head, t["q_norm"], t["k_norm"],
                                    t["cos"], t["sin"], layout.qk_eps,
                                    buf("att_in", (B, C, 3 * HD)))
        r, lse = lib.causal_attention(att_in, H, None, buf("r", (B, C, HD)))
    else:  # GPT-2's attention: the kernel adds the QKV bias in place
        att_in = qkv
        r, lse = lib.causal_attention(qkv, H, t["b_qkv"], buf("r", (B, C, HD)))
    r2 = r.view(N, HD)  # r (B, C, H·D), lse (B, H, C)
    x1 = torch.addmm(x0, r2, t["w_out"].t(), out=buf("x1", (N, E)))  # x + R·W_oᵀ
    if t["b_out"] is not None:
        x1 += t["b_out"]
    f_in, st2 = norm_forward(lib, layout.norm, x1, t["ln2_w"], t["ln2_b"], layout.eps2,
                             buf("f_in", (N, E)))
    g, kept = mlp_forward(lib, layout.mlp, f_in, t, buf)
    y = torch.addmm(x1, g, t["w_down"].t())  # x1 + MLP·W_downᵀ
    if t["b_down"] is not None:
        y += t["b_down"]
    return y.view(B, C, E), (x0, a_in, qk, rs_qk, att_in, r2, lse, x1, f_in), (st1, st2, kept)


#: The per-thread buffers of :func:`block_inference` (apart from the training block's).
INFERENCE = Scratch()


def block_inference(lib: Library, layout: Layout, x: Tensor, *tensors: Tensor | None
                    ) -> Tensor:
    """The block without gradients (evaluation): :func:`block_forward`, the training
    step's math on the same kernels, with its temporaries in per-thread buffers that
    every block and call reuses (:data:`INFERENCE`) and nothing kept for backward.

    A new tensor of MiBs is memory the allocator maps anew, one page fault per 4 KiB page
    on first touch: at the speedrun's evaluation shape (64 windows of 64 tokens, E = 128)
    those were ~300,000 faults per whole-split evaluation, ~1/5 of its CPU time.
    ``tensors`` in :data:`TENSORS` order; returns a new tensor (B, C, E)."""
    t = dict(zip(TENSORS, tensors, strict=True))
    with torch.no_grad():
        return block_forward(lib, layout, x, t, _inference_buffer)[0]


def _inference_buffer(name: str, shape: tuple[int, ...]) -> Tensor:
    with torch.inference_mode(False):  # a plain tensor, writable in and out of the mode
        return INFERENCE.get(name, shape)


class VariantBlockFn(torch.autograd.Function):
    """One variant block for CPU training as one autograd step (see the module docstring):
    ``VariantBlockFn.apply(x, layout, lib, *tensors)`` with ``tensors`` in
    :data:`TENSORS` order; ``cos``/``sin`` are :func:`rope_tables` (None: no RoPE)."""

    @staticmethod
    def forward(ctx, x: Tensor, layout: Layout, lib: Library, *tensors: Tensor | None
                ) -> Tensor:
        y, main, (st1, st2, kept) = block_forward(lib, layout, x,
                                                  dict(zip(TENSORS, tensors, strict=True)))
        ctx.layout, ctx.lib, ctx.shape = layout, lib, tuple(x.shape)
        ctx.counts = (len(st1), len(st2), len(kept))
        ctx.save_for_backward(*main, *st1, *st2, *kept, *tensors)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        n1, n2, nk = ctx.counts
        stats = (tuple(saved[9:9 + n1]), tuple(saved[9 + n1:9 + n1 + n2]))
        kept = tuple(saved[9 + n1 + n2:9 + n1 + n2 + nk])
        t = dict(zip(TENSORS, saved[9 + n1 + n2 + nk:], strict=True))
        need = dict(zip(TENSORS, ctx.needs_input_grad[3:], strict=True))
        grad_x, grads = block_backward(ctx.lib, ctx.layout, grad_y, tuple(saved[:9]), stats,
                                       kept, t, need)
        return (grad_x, None, None, *(grads.get(n) for n in TENSORS))


def block_backward(lib: Library, layout: Layout, grad_y: Tensor, main: tuple[Tensor | None, ...],
                   stats: tuple[tuple[Tensor, ...], tuple[Tensor, ...]],
                   kept: tuple[Tensor, ...], t: dict[str, Tensor | None],
                   need: dict[str, bool]) -> tuple[Tensor, dict[str, Tensor | None]]:
    """:class:`VariantBlockFn`'s backward from dL/dy (B, C, E): (dL/dx, the tensors'
    gradients by :data:`TENSORS` name, None where not needed). ``main``, ``stats`` and
    ``kept`` are :func:`block_forward`'s intermediates, statistics and kept
    pre-activations; ``t`` the block's tensors."""
    x0, a_in, qk, rs_qk, att_in, r2, lse, x1, f_in = main
    st1, st2 = stats
    gy = grad_y.contiguous().view(x0.shape)  # (B·C, E)
    grads = _mlp_grads(lib, layout.mlp, gy, f_in, kept, t, need)
    grad_x1, grads["ln2_w"], grads["ln2_b"] = norm_backward(  # + gy: the residual path
        lib, layout.norm, grads.pop("f_in"), x1, t["ln2_w"], st2, need["ln2_w"],
        need["ln2_b"], gy)
    grads["w_out"] = gemm.gtx(grad_x1, r2) if need["w_out"] else None
    grads["b_out"] = grad_x1.sum(0) if t["b_out"] is not None and need["b_out"] else None
    grad_r = gemm.xw(grad_x1, t["w_out"]).view(*grad_y.shape[:2], -1)  # (B, C, H·D)
    grad_qkv = _attention_grads(lib, layout, grad_r, att_in, r2, lse, qk, rs_qk, t, need,
                                grads)
    g2 = grad_qkv.view(x0.shape[0], -1)  # (B·C, 3·H·D)
    grads["w_qkv"] = gemm.gtx(g2, a_in) if need["w_qkv"] else None
    grad_x, grads["ln1_w"], grads["ln1_b"] = norm_backward(  # + grad_x1: the residual
        lib, layout.norm, gemm.xw(g2, t["w_qkv"]), x0, t["ln1_w"], st1, need["ln1_w"],
        need["ln1_b"], grad_x1)
    return grad_x.view(grad_y.shape), grads


@functools.lru_cache(maxsize=16)
def rope_tables(C: int, head_dim: int, theta: float, device: torch.device
                ) -> tuple[Tensor, Tensor]:
    """cos and sin± (C, 1, D) of positions 0 .. C-1 (attention.rope_angles), shaped to
    broadcast over the heads of (B, C, H, D): made once per shape, shared by every block
    and step (read only)."""
    with torch.inference_mode(False):  # made in an evaluation, still saved in training
        cos, sin = rope_angles(0, C, head_dim, theta, device)
        return cos[:, None], signed_sin(sin)[:, None]


def _mlp_grads(lib: Library, kind: str, gy: Tensor, f_in: Tensor, kept: tuple[Tensor, ...],
               t: dict[str, Tensor | None], need: dict[str, bool]) -> dict[str, Tensor | None]:
    """The MLP's gradients from dL/dy (B·C, E): its weights' and biases', and "f_in"."""
    grad_g = gemm.xw(gy, t["w_down"])  # (B·C, E)·(E, F) -> (B·C, F)
    g, grad_h, grad_gate = mlp_backward(lib, kind, grad_g, kept)
    grads: dict[str, Tensor | None] = {
        "w_down": gemm.gtx(gy, g) if need["w_down"] else None,
        "b_down": gy.sum(0) if t["b_down"] is not None and need["b_down"] else None,
        "w_up": gemm.gtx(grad_h, f_in) if need["w_up"] else None,
        "b_up": grad_h.sum(0) if t["b_up"] is not None and need["b_up"] else None,
        "f_in": gemm.xw(grad_h, t["w_up"])}
    if grad_gate is not None:
        grads["w_gate"] = gemm.gtx(grad_gate, f_in) if need["w_gate"] else None
        grads["b_gate"] = grad_gate.sum(0) if t["b_gate"] is not None and need["b_gate"] \
            else None
        grads["f_in"].addmm_(grad_gate, t["w_gate"])
    return grads


def _attention_grads(lib: Library, layout: Layout, grad_r: Tensor, att_in: Tensor,
                     r2: Tensor, lse: Tensor, qk: Tensor | None, rs_qk: Tensor | None,
                     t: dict[str, Tensor | None], need: dict[str, bool],
                     grads: dict[str, Tensor | None]) -> Tensor:
    """dL/dqkv (B, C, (H + 2·H_kv)·D) from dL/dR, through the kernel, the repeated
    key/value heads and QK-norm/RoPE; puts the QKV bias's and the QK-norm gains'
    gradients into ``grads``."""
    B, C, HD = grad_r.shape
    H, Hkv = layout.n_head, layout.n_kv_head
    r = r2.view(B, C, HD)
    if qk is None:  # GPT-2's attention: the kernel also sums the bias's gradient
        grad_qkv, grads["b_qkv"] = lib.causal_attention_backward(
            grad_r, att_in, r, lse, H, bias_grad=t["b_qkv"] is not None and need["b_qkv"])
        return grad_qkv
    grad_att, _ = lib.causal_attention_backward(grad_r, att_in, r, lse, H)
    grad_qkv, g_w = lib.qk_rope_backward(grad_att, qk, H, Hkv, t["q_norm"], t["k_norm"],
                                         rs_qk, t["cos"], t["sin"],
                                         need["q_norm"] or need["k_norm"])
    if g_w is not None:
        grads["q_norm"], grads["k_norm"] = g_w[0], g_w[1]
    if t["b_qkv"] is not None and need["b_qkv"]:
        grads["b_qkv"] = grad_qkv.view(B * C, -1).sum(0)
    return grad_qkv
