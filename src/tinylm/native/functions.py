"""The autograd Functions of the fast training paths: each computes exactly the math of
the reference modules in tinylm.core.model / tinylm.core.attention (docs/attention.md), with
fewer saved tensors and fewer, larger steps. They are applied by
:mod:`tinylm.native.plan`, never by the model itself.

- :class:`FeedForwardFn`: the FFN as one step that recomputes GELU in backward
  (any device; the native GELU pass on CPU, torch's elsewhere).
- :class:`CausalAttentionFn`: projections + causal attention, native kernels (CPU).
- :class:`BlockFn`: a whole pre-norm block, native kernels (CPU).

Each Function takes the :class:`~tinylm.native.ops.Library` it runs on as an argument
(None: torch's ops, where allowed), so forward and backward use the same kernels.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor

from tinylm.native import gemm, ops
from tinylm.native.ops import Library


class Scratch(threading.local):
    """Buffers for a block's float32 temporaries, kept per thread and reused from one
    call to the next: the FFN's GELU(h) (forward, and its recomputation in backward),
    dL/dGELU(h), dL/dqkv and dL/dR. Each is dead when the step that made it returns, and
    the blocks of a model run one after another, so one buffer per name serves them all.
    The attention's two (dL/dqkv, dL/dR) are made after the FFN's two are dead in the
    block's backward, so they are views of those (:meth:`get`'s ``within``).

    A fresh tensor of these sizes (MiBs) is memory the allocator maps anew, and every
    page of it faults on first touch: at 4×128 that was ~1,000 page faults per training
    step. Reused buffers are mapped once. A new shape replaces the buffer."""

    def __init__(self) -> None:
        self.buffers: dict[str, Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], within: str | None = None) -> Tensor:
        """The buffer ``name`` of ``shape``; with ``within`` (the caller's promise that
        the two are never live at once), a view of the front of that buffer where it
        holds enough floats, else a buffer of its own."""
        host = self.buffers.get(within) if within is not None else None
        n = math.prod(shape)
        if host is not None and host.numel() >= n:
            self.buffers.pop(name, None)
            return host.view(-1)[:n].view(shape)
        t = self.buffers.get(name)
        if t is None or t.shape != shape:
            self.buffers.pop(name, None)  # freed before its successor is allocated
            t = self.buffers[name] = torch.empty(shape)
        return t


SCRATCH = Scratch()


def bias_gelu_(lib: Library | None, h: Tensor, bias: Tensor | None) -> Tensor:
    """``h += bias`` in place, then GELU_tanh(h): natively where the library takes the
    tensors (float32, CPU, contiguous), with torch's ops otherwise."""
    if lib is not None and _native_elementwise(h, bias):
        return lib.bias_gelu_(h, bias)
    if bias is not None:
        h.add_(bias)
    return F.gelu(h, approximate="tanh")


def gelu_backward(lib: Library | None, grad: Tensor, h: Tensor, sum_rows: bool,
                  scratch: Scratch | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dL/dh, GELU(h), Σ_rows dL/dh or None) from dL/dGELU(h); ``grad`` may be reused,
    and natively GELU(h) goes to a ``scratch`` buffer where given."""
    if lib is not None and _native_elementwise(h, None) and grad.is_contiguous() \
            and grad.dtype == torch.float32 and grad.shape == h.shape:
        out = scratch.get("ffn_act", tuple(h.shape)) if scratch is not None else None
        return lib.gelu_backward(grad, h, sum_rows, out)
    grad_h = torch.ops.aten.gelu_backward(grad, h, approximate="tanh")
    colsum = grad_h.reshape(-1, h.shape[-1]).sum(0) if sum_rows else None
    return grad_h, F.gelu(h, approximate="tanh"), colsum


def _native_elementwise(h: Tensor, bias: Tensor | None) -> bool:
    return (h.dtype == torch.float32 and h.device.type == "cpu" and h.is_contiguous()
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"
                                  and bias.is_contiguous())))


def ffn_backward(lib: Library | None, gy: Tensor, x2: Tensor, h: Tensor, w_up: Tensor,
                 w_down: Tensor, need: tuple[bool, bool, bool, bool],
                 scratch: Scratch | None = None) -> tuple[Tensor | None, ...]:
    """Backward of y = GELU(h)·W_downᵀ (+ b_down), h = x2·W_upᵀ + b_up, from dL/dy
    (B·C, E) and the kept x2, h: the gradients of (x2, W_up, b_up, W_down) — each only
    where ``need`` says so. GELU(h) is recomputed; b_up's gradient is summed in the
    same native pass (b_down's is dL/dy summed over rows, left to the caller). With
    ``scratch`` (float32 only), the temporaries go to its buffers."""
    out = scratch.get("ffn_grad", tuple(h.shape)) if scratch is not None else None
    grad_g = gemm.xw(gy, w_down, out=out)  # (B·C, E)·(E, 4E) -> (B·C, 4E)
    grad_h, g, grad_b_up = gelu_backward(lib, grad_g, h, need[2], scratch)
    grad_w_down = gemm.gtx(gy, g) if need[3] else None  # (E, B·C)·(B·C, 4E) -> (E, 4E)
    grad_w_up = gemm.gtx(grad_h, x2) if need[1] else None  # (4E, B·C)·(B·C, E) -> (4E, E)
    grad_x2 = gemm.xw(grad_h, w_up) if need[0] else None  # (B·C, 4E)·(4E, E) -> (B·C, E)
    return grad_x2, grad_w_up, grad_b_up, grad_w_down


class FeedForwardFn(torch.autograd.Function):
    """The FFN for training, y = GELU_tanh(x·W_upᵀ + b_up)·W_downᵀ + b_down, as one
    autograd step that keeps only x and h = x·W_upᵀ + b_up for backward.

    Plain autograd would also keep GELU(h), (B, C, 4E) — with h the largest activations
    of a block. GELU is cheap, so backward recomputes it from h instead: the same values
    and gradients, 4E fewer floats per token per layer. On CPU the bias add and GELU
    run as one native pass (:func:`bias_gelu_`), and backward's GELU
    gradient and recomputation as another, where torch's tanh-GELU is slow.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w_up: Tensor, b_up: Tensor | None, w_down: Tensor,
                b_down: Tensor | None, lib: Library | None) -> Tensor:
        y, h = ffn_forward(lib, x, w_up, b_up, w_down, b_down)
        ctx.save_for_backward(x, h, w_up, w_down)
        ctx.biases, ctx.lib = (b_up is not None, b_down is not None), lib
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        need = ctx.needs_input_grad
        grads = ffn_step_backward(ctx.lib, grad_y, *ctx.saved_tensors,
                                  (need[0], need[1], ctx.biases[0] and need[2], need[3],
                                   ctx.biases[1] and need[4]))
        return (*grads, None)


def ffn_forward(lib: Library | None, x: Tensor, w_up: Tensor, b_up: Tensor | None,
                w_down: Tensor, b_down: Tensor | None) -> tuple[Tensor, Tensor]:
    """:class:`FeedForwardFn`'s forward: (y (B, C, E), h = x·W_upᵀ + b_up (B·C, 4E), kept
    for backward); both new tensors."""
    x2 = x.reshape(-1, x.shape[-1])  # (B, C, E) -> (B·C, E)
    h = gemm.xwt(x2, w_up)  # (B·C, E)·(E, 4E) -> (B·C, 4E)
    g = bias_gelu_(lib, h, b_up)  # h += b_up in place; g = GELU(h)
    y = gemm.xwt(g, w_down)  # (B·C, 4E)·(4E, E) -> (B·C, E)
    if b_down is not None:
        y += b_down
    return y.view(*x.shape[:-1], y.shape[-1]), h  # -> (B, C, E)


def ffn_step_backward(lib: Library | None, grad_y: Tensor, x: Tensor, h: Tensor,
                      w_up: Tensor, w_down: Tensor, need: tuple[bool, ...]
                      ) -> tuple[Tensor | None, ...]:
    """:class:`FeedForwardFn`'s backward: the gradients of (x, w_up, b_up, w_down,
    b_down), each only where ``need`` says so, from dL/dy and :func:`ffn_forward`'s h."""
    # Under autocast h is bf16 while x and the weights stay fp32; backward runs
    # outside autocast, so compute in h's dtype (no-ops in fp32). Autograd casts
    # each returned gradient back to its input's dtype.
    dt = h.dtype
    x2 = x.reshape(-1, x.shape[-1]).to(dt)
    w_up, w_down = w_up.to(dt), w_down.to(dt)
    gy = grad_y.to(dt).reshape(-1, grad_y.shape[-1])  # (B, C, E) -> (B·C, E)
    grad_x2, grad_w_up, grad_b_up, grad_w_down = ffn_backward(
        lib, gy, x2, h, w_up, w_down, need[:4])
    grad_b_down = gy.sum(0) if need[4] else None  # (E,)
    grad_x = grad_x2.view(grad_y.shape[:-1] + (w_up.shape[1],)) if need[0] else None
    return grad_x, grad_w_up, grad_b_up, grad_w_down, grad_b_down


def qkv_attention_backward(lib: Library, grad_r: Tensor, x2: Tensor, w_qkv: Tensor,
                           qkv: Tensor, r: Tensor, lse: Tensor, n_head: int,
                           need: tuple[bool, bool, bool], out: Tensor | None = None
                           ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """Backward of qkv = x2·W_qkvᵀ + b (x2 (B·C, E)) followed by the native causal
    attention r = attention(qkv): from dL/dr (B, C, H·D), the gradients of (x2, W_qkv, b)
    — each only where ``need`` says so; dL/dqkv goes to ``out`` (qkv's shape) if given."""
    grad_qkv, grad_b = lib.causal_attention_backward(grad_r, qkv, r, lse, n_head,
                                                    bias_grad=need[2], grad_qkv=out)
    g = grad_qkv.view(-1, grad_qkv.shape[-1])  # (B·C, 3·H·D)
    grad_w = gemm.gtx(g, x2) if need[1] else None  # (3·H·D, B·C)·(B·C, E)
    grad_x2 = gemm.xw(g, w_qkv) if need[0] else None  # (B·C, 3·H·D)·(3·H·D, E)
    return grad_x2, grad_w, grad_b


class CausalAttentionFn(torch.autograd.Function):
    """Multi-head causal attention, projections included, as one autograd step:
    x (B, C, E) -> qkv = x·W_qkvᵀ + b -> heads -> R (B, C, H·D) -> R·W_oᵀ + b_o (B, C, E).

    The CPU kernels (:meth:`Library.causal_attention`) add the QKV bias and read
    each head's Q, K, V in place from qkv, keeping one log-sum-exp per query; backward
    recomputes the attention map from it, writes dQ, dK, dV into one (B, C, 3·H·D)
    gradient and sums the bias's gradient in the same pass. Neither direction splits,
    transposes or concatenates the heads.
    """

    @staticmethod
    def forward(ctx, x: Tensor, w_qkv: Tensor, b_qkv: Tensor | None, w_out: Tensor,
                b_out: Tensor | None, n_head: int, lib: Library) -> Tensor:
        y, qkv, r, lse = attention_forward(lib, x, w_qkv, b_qkv, w_out, b_out, n_head)
        ctx.save_for_backward(x, w_qkv, qkv, r, lse, w_out)
        ctx.n_head, ctx.has_bias, ctx.lib = n_head, b_qkv is not None, lib
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        need = ctx.needs_input_grad
        grads = attention_backward(ctx.lib, grad_y, *ctx.saved_tensors, ctx.n_head,
                                   (need[0], need[1], ctx.has_bias and need[2], need[3],
                                    need[4]))
        return (*grads, None, None)


def attention_forward(lib: Library, x: Tensor, w_qkv: Tensor, b_qkv: Tensor | None,
                      w_out: Tensor, b_out: Tensor | None, n_head: int
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:class:`CausalAttentionFn`'s forward: (y (B, C, E), and what backward needs: qkv
    (B, C, 3·H·D, the bias added), the heads' outputs R (B, C, H·D), their log-sum-exp
    (B, H, C)); each a new tensor."""
    x2 = x.reshape(-1, x.shape[-1])  # (B, C, E) -> (B·C, E)
    qkv = gemm.xwt(x2, w_qkv).view(*x.shape[:-1], w_qkv.shape[0])  # -> (B, C, 3·H·D)
    r, lse = lib.causal_attention(qkv, n_head, b_qkv)  # (B, C, H·D), (B, H, C)
    y = gemm.xwt(r.view(-1, r.shape[-1]), w_out)  # (B·C, H·D)·(H·D, E) -> (B·C, E)
    if b_out is not None:
        y += b_out
    return y.view(*x.shape[:-1], y.shape[-1]), qkv, r, lse


def attention_backward(lib: Library, grad_y: Tensor, x: Tensor, w_qkv: Tensor, qkv: Tensor,
                       r: Tensor, lse: Tensor, w_out: Tensor, n_head: int,
                       need: tuple[bool, bool, bool, bool, bool]
                       ) -> tuple[Tensor | None, ...]:
    """:class:`CausalAttentionFn`'s backward: the gradients of (x, w_qkv, b_qkv, w_out,
    b_out), each only where ``need`` says so, from :func:`attention_forward`'s tensors."""
    x2 = x.reshape(-1, x.shape[-1])
    gy = grad_y.reshape(-1, grad_y.shape[-1])  # (B·C, E)
    grad_w_out = gemm.gtx(gy, r.view(-1, r.shape[-1])) if need[3] else None  # (E, H·D)
    grad_b_out = gy.sum(0) if need[4] else None
    grad_r = gemm.xw(gy, w_out).view(r.shape)  # (B·C, E)·(E, H·D) -> (B, C, H·D)
    grad_x2, grad_w_qkv, grad_b_qkv = qkv_attention_backward(
        lib, grad_r, x2, w_qkv, qkv, r, lse, n_head, (need[0], need[1], need[2]))
    grad_x = grad_x2.view(*grad_y.shape[:-1], x2.shape[1]) if need[0] else None
    return grad_x, grad_w_qkv, grad_b_qkv, grad_w_out, grad_b_out


class BlockFn(torch.autograd.Function):
    """A whole block for CPU training as one autograd step, with native kernels:

        x1 = x + Attention(LN1(x))          y = x1 + FFN(LN2(x1))

    The same tensors are kept for backward as the block's separate steps would keep
    (LN inputs, LN outputs, qkv, the heads' outputs, the FFN's pre-activation), but
    LayerNorm runs natively (:meth:`Library.layer_norm_residual`: the pass that reads x
    for the norm also writes x + the projection's bias, into which the output
    projection's product accumulates, beta = 1), the big temporaries go to reused
    :class:`Scratch` buffers, and in backward the residual gradient is added by the
    LayerNorm backward pass itself, which also sums it over rows for the projection's
    bias gradient — where a graph
    of a dozen small autograd steps per block (LN, projections, adds, gradient
    accumulation) costs more than their arithmetic at small sizes. Applied by
    :class:`tinylm.native.plan.NativeBlock` where :func:`tinylm.native.plan.eligibility`
    found the block's parts plain.
    """

    @staticmethod
    def forward(ctx, x: Tensor, n_head: int, eps1: float, eps2: float,
                ln1_w: Tensor | None, ln1_b: Tensor | None, w_qkv: Tensor,
                b_qkv: Tensor | None, w_out: Tensor, b_out: Tensor | None,
                ln2_w: Tensor | None, ln2_b: Tensor | None, w_up: Tensor,
                b_up: Tensor | None, w_down: Tensor, b_down: Tensor | None,
                lib: Library) -> Tensor:
        y, acts = block_forward(lib, x, n_head, eps1, eps2, ln1_w, ln1_b, w_qkv, b_qkv,
                                w_out, b_out, ln2_w, ln2_b, w_up, b_up, w_down, b_down)
        ctx.save_for_backward(x, *acts, ln1_w, w_qkv, w_out, ln2_w, w_up, w_down)
        ctx.n_head, ctx.lib = n_head, lib
        ctx.biases = (b_qkv is not None, b_out is not None, b_up is not None,
                      b_down is not None)
        return y

    @staticmethod
    def backward(ctx, grad_y: Tensor) -> tuple[Tensor | None, ...]:
        saved, need = ctx.saved_tensors, ctx.needs_input_grad
        grads = block_backward(ctx.lib, grad_y, saved[0], saved[1:12], saved[12:],
                               ctx.n_head, ctx.biases, (need[0], *need[4:16]))
        return (grads[0], None, None, None, *grads[1:], None)


#: The block's activations kept for backward, in :func:`block_forward`'s order.
BLOCK_SAVED = ops.BLOCK_SAVED
_one_call = [True]  # whether a block whose products all run on tinylm's kernel is one call


@contextmanager
def composed_blocks() -> Iterator[None]:
    """Within this block, :func:`block_forward` and :func:`block_backward` always call
    the kernels one by one from Python (tests and benchmarks compare the two ways)."""
    _one_call[0] = False
    try:
        yield
    finally:
        _one_call[0] = True


def _one_call_lib(lib: Library, x: Tensor, *weights: Tensor) -> Library | None:
    """``lib`` where the whole block runs as one native call (csrc/train_block.c): every
    product on tinylm's kernel (gemm.all_native), float32 activations."""
    if not _one_call[0] or x.dtype != torch.float32 or \
            gemm.all_native(x.numel() // x.shape[-1], *weights) is not lib:
        return None
    return lib


def block_forward(lib: Library, x: Tensor, n_head: int, eps1: float, eps2: float,
                  ln1_w: Tensor | None, ln1_b: Tensor | None, w_qkv: Tensor,
                  b_qkv: Tensor | None, w_out: Tensor, b_out: Tensor | None,
                  ln2_w: Tensor | None, ln2_b: Tensor | None, w_up: Tensor,
                  b_up: Tensor | None, w_down: Tensor, b_down: Tensor | None
                  ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """:class:`BlockFn`'s forward: (y (B, C, E), the activations backward needs, in
    :data:`BLOCK_SAVED` order). Every returned tensor is new (none is a view of x or a
    :class:`Scratch` buffer), so the torch.library op (tinylm.native.customops) returns
    them as they are. Where every product goes to tinylm's kernel (gemm.all_native),
    these same steps run as one native call (csrc/train_block.c)."""
    B, C, E = x.shape
    if _one_call_lib(lib, x, w_qkv, w_out, w_up, w_down) is not None:
        params = (ln1_w, ln1_b, w_qkv, b_qkv, w_out, b_out, ln2_w, ln2_b, w_up, b_up, w_down,
                  b_down)  # a LoRA layer's effective weight is an expression: made whole
        return lib.block_train_forward(
            x.contiguous(), n_head, eps1, eps2, tuple(_whole(p) for p in params),
            SCRATCH.get("ffn_act", (B * C, w_up.shape[0])))
    x0 = x.contiguous().view(-1, E)  # (B·C, E)
    # each LayerNorm pass also starts its branch's residual sum: x + b_o, x1 + b_down
    a_in, mu1, rs1, x1 = lib.layer_norm_residual(x0, ln1_w, ln1_b, eps1, b_out)
    qkv = gemm.xwt(a_in, w_qkv).view(B, C, w_qkv.shape[0])  # (B, C, 3·H·D)
    r, lse = lib.causal_attention(qkv, n_head, b_qkv)  # (B, C, H·D), (B, H, C)
    r2 = r.view(B * C, -1)
    x1 = gemm.xwt_add(x1, r2, w_out)  # x1 = x + b_o + R·W_oᵀ
    f_in, mu2, rs2, y = lib.layer_norm_residual(x1, ln2_w, ln2_b, eps2, b_down)
    h = gemm.xwt(f_in, w_up)  # (B·C, 4E)
    g = lib.bias_gelu_(h, b_up, SCRATCH.get("ffn_act", tuple(h.shape)))  # h += b_up
    y = gemm.xwt_add(y, g, w_down)  # y = x1 + b_down + GELU(h)·W_downᵀ
    return y.view(B, C, E), (mu1, rs1, a_in, qkv, r2, lse, x1, mu2, rs2, f_in, h)


def block_backward(lib: Library, grad_y: Tensor, x: Tensor, acts: tuple[Tensor, ...],
                   weights: tuple[Tensor | None, ...], n_head: int,
                   biases: tuple[bool, bool, bool, bool], need: tuple[bool, ...]
                   ) -> tuple[Tensor | None, ...]:
    """:class:`BlockFn`'s backward from dL/dy: the gradients of (x, ln1_w, ln1_b, w_qkv,
    b_qkv, w_out, b_out, ln2_w, ln2_b, w_up, b_up, w_down, b_down), each only where
    ``need`` (in that order) says so. ``acts`` are :func:`block_forward`'s, ``weights``
    (ln1_w, w_qkv, w_out, ln2_w, w_up, w_down), ``biases`` whether (b_qkv, b_out, b_up,
    b_down) exist. As :func:`block_forward`, one native call where it can be."""
    ln1_w, w_qkv, w_out, ln2_w, w_up, w_down = weights
    if _one_call_lib(lib, x, w_qkv, w_out, w_up, w_down) is not None:
        return _block_backward_one_call(lib, grad_y, x, acts, weights, n_head, biases, need)
    mu1, rs1, a_in, qkv, r2, lse, x1, mu2, rs2, f_in, h = acts
    has_b_qkv, has_b_out, has_b_up, has_b_down = biases
    shape = tuple(x.shape[:2])
    x0 = x.contiguous().view(x1.shape)
    gy = grad_y.contiguous().view(x1.shape)  # (B·C, E)
    # FFN: y = x1 + GELU(f_in·W_upᵀ + b_up)·W_downᵀ + b_down
    grad_f_in, grad_w_up, grad_b_up, grad_w_down = ffn_backward(
        lib, gy, f_in, h, w_up, w_down, (True, need[9], has_b_up and need[10], need[11]),
        SCRATCH)
    # + gy: the residual path; b_down's gradient (gy summed over rows) in that pass
    grad_b_down = torch.empty(gy.shape[1]) if has_b_down and need[12] else None
    grad_x1, grad_ln2_w, grad_ln2_b = lib.layer_norm_backward(
        grad_f_in, x1, ln2_w, mu2, rs2, ln2_w is not None and need[7], need[8], gy,
        grad_b_down)
    # attention: x1 = x + R·W_oᵀ + b_out, R = attention(LN1(x)·W_qkvᵀ + b_qkv); the
    # FFN's buffers are dead now: dL/dR and dL/dqkv are views of them
    grad_w_out = gemm.gtx(grad_x1, r2) if need[5] else None
    grad_r = gemm.xw(grad_x1, w_out, out=SCRATCH.get("attn_grad", tuple(r2.shape),
                                                      within="ffn_act"))
    grad_a_in, grad_w_qkv, grad_b_qkv = qkv_attention_backward(  # (B, C, H·D) grad_r
        lib, grad_r.view(*shape, -1), a_in, w_qkv, qkv, r2.view(*shape, -1), lse,
        n_head, (True, need[3], has_b_qkv and need[4]),
        SCRATCH.get("qkv_grad", tuple(qkv.shape), within="ffn_grad"))
    # + grad_x1: the residual path, and b_out's gradient (grad_x1 summed) with it
    grad_b_out = torch.empty(gy.shape[1]) if has_b_out and need[6] else None
    grad_x, grad_ln1_w, grad_ln1_b = lib.layer_norm_backward(
        grad_a_in, x0, ln1_w, mu1, rs1, ln1_w is not None and need[1], need[2], grad_x1,
        grad_b_out)
    return (grad_x.view(grad_y.shape), grad_ln1_w, grad_ln1_b, grad_w_qkv, grad_b_qkv,
            grad_w_out, grad_b_out, grad_ln2_w, grad_ln2_b, grad_w_up, grad_b_up,
            grad_w_down, grad_b_down)


def _block_backward_one_call(lib: Library, grad_y: Tensor, x: Tensor,
                             acts: tuple[Tensor, ...], weights: tuple[Tensor | None, ...],
                             n_head: int, biases: tuple[bool, bool, bool, bool],
                             need: tuple[bool, ...]) -> tuple[Tensor | None, ...]:
    """:func:`block_backward` as one native call (:meth:`Library.block_train_backward`),
    its temporaries in :data:`SCRATCH` (the same buffers, the same reuse)."""
    ln1_w, w_qkv, w_out, ln2_w, w_up, w_down = weights
    N, F_, HD = acts[0].shape[0], w_up.shape[0], w_out.shape[1]
    scratch = {"s_grad": SCRATCH.get("ffn_grad", (N, F_)),
               "s_act": SCRATCH.get("ffn_act", (N, F_))}
    scratch |= {"s_attn": SCRATCH.get("attn_grad", (N, HD), within="ffn_act"),
                "s_qkv": SCRATCH.get("qkv_grad", (N, 3 * HD), within="ffn_grad"),
                "s_t1": SCRATCH.get("block_t1", (N, x.shape[-1])),
                "s_gx1": SCRATCH.get("block_gx1", (N, x.shape[-1]))}
    # the gradients wanted, of (ln1_w, ln1_b, w_qkv, b_qkv, w_out, b_out, ln2_w, ln2_b,
    # w_up, b_up, w_down, b_down): where needed and the parameter exists
    has = (ln1_w is not None, True, True, biases[0], True, biases[1], ln2_w is not None,
           True, True, biases[2], True, biases[3])
    want = tuple(h and n for h, n in zip(has, need[1:], strict=True))
    return lib.block_train_backward(grad_y, x.contiguous(), acts, dict(zip(
        ("ln1_w", "w_qkv", "w_out", "ln2_w", "w_up", "w_down"),
        (_whole(w) for w in weights), strict=True)), n_head, want, scratch)


def _whole(t: Tensor | None) -> Tensor | None:
    """``t`` contiguous (itself where it is), None as None."""
    return t if t is None else t.contiguous()
