"""The fast training and evaluation paths as PyTorch custom ops (``torch.library``), so
``torch.compile`` traces through them instead of breaking its graph at each ctypes call.

Each op is one of the steps the accelerated modules take (:mod:`tinylm.native.plan`):

=============================  ==========================================================
``tinylm::block``              :class:`~tinylm.native.functions.BlockFn` (GPT-2's block)
``tinylm::variant_block``      :class:`~tinylm.native.variants.VariantBlockFn`
``tinylm::block_inference``    :func:`~tinylm.native.variants.block_inference` (no grad)
``tinylm::attention``          :class:`~tinylm.native.functions.CausalAttentionFn`
``tinylm::ffn``                :class:`~tinylm.native.functions.FeedForwardFn`
=============================  ==========================================================

and each training op has a ``*_backward`` op, its gradient formula
(``register_autograd``). The ops run the same functions as the autograd Functions
(``functions.block_forward`` …), so they compute the same numbers; each has a fake
(meta) implementation that gives its outputs' shapes, and none mutates its inputs
(``mutates_args=()``): a forward op returns its output and the activations its backward
needs as new tensors, and its backward op returns one gradient per differentiable input
(an empty tensor where none is needed; the autograd formula turns those into None).
``tests/test_compile.py`` runs ``torch.library.opcheck`` on every op.

In eager mode the accelerated modules call the autograd Functions directly: an op's
dispatch (schema parsing, the autograd wrapper) costs microseconds per call that the
Functions do not pay. The ops are called where ``torch.compiler.is_compiling()``: inside
a graph that dynamo traces.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tinylm.native import functions, ops, variants

_EMPTY = (0,)


def _lib() -> ops.Library:
    """The loaded library (a compiled graph calls its ops where the plan chose them)."""
    lib = ops.load()
    if lib is None:
        raise ops.OpError("the tinylm native library is not loaded; a graph with tinylm's "
                          "ops needs it (tinylm.native.accelerate loads it)")
    return lib


def _grads(grads: tuple[Tensor | None, ...], like: Tensor) -> list[Tensor]:
    """An op's gradient list: each gradient, or an empty tensor for None; a gradient that
    shares memory with an earlier one (QK-norm's two gains come as rows of one tensor)
    is copied, as an op's outputs may not alias each other."""
    out, seen = [], set()
    for g in grads:
        if g is None:
            g = like.new_empty(_EMPTY)
        elif g.untyped_storage().data_ptr() in seen:
            g = g.clone()
        seen.add(g.untyped_storage().data_ptr())
        out.append(g)
    return out


def _nones(grads: list[Tensor], need: tuple[bool, ...]) -> list[Tensor | None]:
    """The autograd formula's gradients: None where not needed (the op's empty tensor)."""
    return [g if n else None for g, n in zip(grads, need, strict=True)]


# --- tinylm::block: GPT-2's block ---------------------------------------------------------

_BLOCK_ARGS = ("Tensor x, int n_head, float eps1, float eps2, Tensor? ln1_w, Tensor? ln1_b, "
               "Tensor w_qkv, Tensor? b_qkv, Tensor w_out, Tensor? b_out, Tensor? ln2_w, "
               "Tensor? ln2_b, Tensor w_up, Tensor? b_up, Tensor w_down, Tensor? b_down")


@torch.library.custom_op("tinylm::block", mutates_args=(),
                         schema=f"({_BLOCK_ARGS}) -> Tensor[]")
def block(x: Tensor, n_head: int, eps1: float, eps2: float, ln1_w: Tensor | None,
          ln1_b: Tensor | None, w_qkv: Tensor, b_qkv: Tensor | None, w_out: Tensor,
          b_out: Tensor | None, ln2_w: Tensor | None, ln2_b: Tensor | None, w_up: Tensor,
          b_up: Tensor | None, w_down: Tensor, b_down: Tensor | None) -> list[Tensor]:
    """[y, *activations] of :func:`tinylm.native.functions.block_forward`."""
    y, acts = functions.block_forward(_lib(), x, n_head, eps1, eps2, ln1_w, ln1_b, w_qkv,
                                      b_qkv, w_out, b_out, ln2_w, ln2_b, w_up, b_up,
                                      w_down, b_down)
    return [y, *acts]


@block.register_fake
def _block_fake(x, n_head, eps1, eps2, ln1_w, ln1_b, w_qkv, b_qkv, w_out, b_out, ln2_w,
                ln2_b, w_up, b_up, w_down, b_down):
    B, C, E = x.shape
    N, HD, F_ = B * C, w_out.shape[1], w_up.shape[0]
    e = x.new_empty
    # y, mu1, rs1, a_in, qkv, r2, lse, x1, mu2, rs2, f_in, h
    return [e(B, C, E), e(N), e(N), e(N, E), e(B, C, w_qkv.shape[0]), e(N, HD),
            e(B, n_head, C), e(N, E), e(N), e(N), e(N, E), e(N, F_)]


@torch.library.custom_op(
    "tinylm::block_backward", mutates_args=(),
    schema="(Tensor grad_y, Tensor x, Tensor[] acts, Tensor? ln1_w, Tensor w_qkv, "
           "Tensor w_out, Tensor? ln2_w, Tensor w_up, Tensor w_down, int n_head, "
           "bool[] biases, bool[] need) -> Tensor[]")
def block_backward(grad_y: Tensor, x: Tensor, acts: list[Tensor], ln1_w: Tensor | None,
                   w_qkv: Tensor, w_out: Tensor, ln2_w: Tensor | None, w_up: Tensor,
                   w_down: Tensor, n_head: int, biases: list[bool], need: list[bool]
                   ) -> list[Tensor]:
    """The gradients of (x, ln1_w, ln1_b, w_qkv, b_qkv, w_out, b_out, ln2_w, ln2_b, w_up,
    b_up, w_down, b_down) (:func:`tinylm.native.functions.block_backward`)."""
    grads = functions.block_backward(_lib(), grad_y, x, tuple(acts),
                                     (ln1_w, w_qkv, w_out, ln2_w, w_up, w_down), n_head,
                                     tuple(biases), tuple(need))
    return _grads(grads, x)


@block_backward.register_fake
def _block_backward_fake(grad_y, x, acts, ln1_w, w_qkv, w_out, ln2_w, w_up, w_down, n_head,
                         biases, need):
    E, F_ = x.shape[-1], w_up.shape[0]
    shapes = (tuple(x.shape), (E,), (E,), tuple(w_qkv.shape), (w_qkv.shape[0],),
              tuple(w_out.shape), (E,), (E,), (E,), tuple(w_up.shape), (F_,),
              tuple(w_down.shape), (E,))
    return [x.new_empty(s if n else _EMPTY) for s, n in zip(shapes, need, strict=True)]


def _block_setup(ctx, inputs, output) -> None:
    x, n_head, _e1, _e2, ln1_w, _ln1_b, w_qkv, b_qkv, w_out, b_out, ln2_w, _ln2_b, w_up, \
        b_up, w_down, b_down = inputs
    ctx.save_for_backward(x, ln1_w, w_qkv, w_out, ln2_w, w_up, w_down, *output[1:])
    ctx.n_head = n_head
    ctx.biases = [t is not None for t in (b_qkv, b_out, b_up, b_down)]


def _block_autograd(ctx, grads: list[Tensor | None]) -> tuple[Tensor | None, ...]:
    x, ln1_w, w_qkv, w_out, ln2_w, w_up, w_down, *acts = ctx.saved_tensors
    need = (ctx.needs_input_grad[0], *ctx.needs_input_grad[4:16])
    got = block_backward(grads[0], x, acts, ln1_w, w_qkv, w_out, ln2_w, w_up, w_down,
                         ctx.n_head, ctx.biases, list(need))
    g = _nones(got, need)
    return (g[0], None, None, None, *g[1:])


block.register_autograd(_block_autograd, setup_context=_block_setup)


# --- tinylm::variant_block and tinylm::block_inference: any layout -------------------------

_LAYOUT_ARGS = "int n_head, int n_kv_head, str norm, str mlp, float eps1, float eps2, float qk_eps"


def _layout(n_head: int, n_kv_head: int, norm: str, mlp: str, eps1: float, eps2: float,
            qk_eps: float) -> variants.Layout:
    return variants.Layout(n_head, n_kv_head, norm, mlp, eps1, eps2, qk_eps)


def block_tensors(x: Tensor, tensors: tuple[Tensor | None, ...]) -> list[Tensor]:
    """A block's tensors (``variants.TENSORS`` order) as the ops take them: an empty
    tensor for a missing one (a ``Tensor?[]`` argument would carry no gradients)."""
    return [t if t is not None else x.new_empty(_EMPTY) for t in tensors]


def _present(tensors: list[Tensor]) -> dict[str, Tensor | None]:
    """The block's tensors by name, None for the empty placeholders."""
    return {name: t if t.numel() else None
            for name, t in zip(variants.TENSORS, tensors, strict=True)}


def layout_args(layout: variants.Layout) -> tuple:
    """A :class:`~tinylm.native.variants.Layout` as the ops' arguments."""
    return (layout.n_head, layout.n_kv_head, layout.norm, layout.mlp, layout.eps1,
            layout.eps2, layout.qk_eps)


@torch.library.custom_op("tinylm::variant_block", mutates_args=(),
                         schema=f"(Tensor x, {_LAYOUT_ARGS}, Tensor[] tensors) -> Tensor[]")
def variant_block(x: Tensor, n_head: int, n_kv_head: int, norm: str, mlp: str, eps1: float,
                  eps2: float, qk_eps: float, tensors: list[Tensor | None]) -> list[Tensor]:
    """[y, a_in, qk, rs_qk, att_in, r2, lse, x1, f_in, *norm statistics, *kept] of
    :func:`tinylm.native.variants.block_forward` (``tensors`` in ``variants.TENSORS``
    order; qk and rs_qk empty where the layout has neither QK-norm, RoPE nor GQA)."""
    layout = _layout(n_head, n_kv_head, norm, mlp, eps1, eps2, qk_eps)
    y, main, (st1, st2, kept) = variants.block_forward(_lib(), layout, x, _present(tensors))
    _x0, a_in, qk, rs_qk, *rest = main
    empty = x.new_empty(_EMPTY)
    return [y, a_in, qk if qk is not None else empty,
            rs_qk if rs_qk is not None else x.new_empty(_EMPTY), *rest, *st1, *st2, *kept]


def _rewritten(n_head: int, n_kv_head: int, t: dict[str, Tensor | None]) -> bool:
    """Whether the layout rewrites qkv before the kernel (QK-norm, RoPE or GQA)."""
    return t["q_norm"] is not None or t["cos"] is not None or n_kv_head != n_head


@variant_block.register_fake
def _variant_block_fake(x, n_head, n_kv_head, norm, mlp, eps1, eps2, qk_eps, tensors):
    t = _present(tensors)
    B, C, E = x.shape
    N, W, HD, F_ = B * C, t["w_qkv"].shape[0], t["w_out"].shape[1], t["w_up"].shape[0]
    e = x.new_empty
    qk = (e(B, C, W), e(B, C, n_head + n_kv_head)) if _rewritten(n_head, n_kv_head, t) \
        else (e(_EMPTY), e(_EMPTY))
    att_in = e(B, C, 3 * HD) if _rewritten(n_head, n_kv_head, t) else e(B, C, W)
    stats = [e(N) for _ in range(2 * (2 if norm == "layernorm" else 1))]  # both norms'
    kept = [e(N, F_) for _ in range(2 if mlp == "swiglu" else 1)]
    return [e(B, C, E), e(N, E), *qk, att_in, e(N, HD), e(B, n_head, C), e(N, E), e(N, E),
            *stats, *kept]


@torch.library.custom_op(
    "tinylm::variant_block_backward", mutates_args=(),
    schema=f"(Tensor grad_y, Tensor x, Tensor[] saved, Tensor[] tensors, {_LAYOUT_ARGS}, "
           "bool[] need) -> Tensor[]")
def variant_block_backward(grad_y: Tensor, x: Tensor, saved: list[Tensor],
                           tensors: list[Tensor | None], n_head: int, n_kv_head: int,
                           norm: str, mlp: str, eps1: float, eps2: float, qk_eps: float,
                           need: list[bool]) -> list[Tensor]:
    """The gradients of (x, *tensors) (:func:`tinylm.native.variants.block_backward`)
    from :func:`variant_block`'s saved outputs."""
    layout = _layout(n_head, n_kv_head, norm, mlp, eps1, eps2, qk_eps)
    t = _present(tensors)
    a_in, qk, rs_qk, att_in, r2, lse, x1, f_in, *rest = saved
    n = 2 if norm == "layernorm" else 1
    rewritten = _rewritten(n_head, n_kv_head, t)
    main = (x.contiguous().view(x1.shape), a_in, qk if rewritten else None,
            rs_qk if rewritten else None, att_in, r2, lse, x1, f_in)
    grad_x, grads = variants.block_backward(
        _lib(), layout, grad_y, main, (tuple(rest[:n]), tuple(rest[n:2 * n])),
        tuple(rest[2 * n:]), t, dict(zip(variants.TENSORS, need[1:], strict=True)))
    return _grads((grad_x, *(grads.get(name) for name in variants.TENSORS)), x)


@variant_block_backward.register_fake
def _variant_block_backward_fake(grad_y, x, saved, tensors, n_head, n_kv_head, norm, mlp,
                                 eps1, eps2, qk_eps, need):
    shapes = [tuple(x.shape)] + [tuple(t.shape) for t in tensors]
    return [x.new_empty(s if n else _EMPTY) for s, n in zip(shapes, need, strict=True)]


def _variant_setup(ctx, inputs, output) -> None:
    x, *layout, tensors = inputs
    ctx.layout = layout
    ctx.n_tensors = len(tensors)
    ctx.save_for_backward(x, *output[1:], *tensors)


def _variant_autograd(ctx, grads: list[Tensor | None]) -> tuple[Tensor | None, ...]:
    saved = ctx.saved_tensors
    x, acts, tensors = saved[0], saved[1:-ctx.n_tensors], saved[-ctx.n_tensors:]
    need = [ctx.needs_input_grad[0]] + [  # the RoPE tables are constants
        bool(f) and t.numel() > 0 and name not in ("cos", "sin")
        for f, t, name in zip(ctx.needs_input_grad[-1], tensors, variants.TENSORS,
                              strict=True)]
    got = _nones(variant_block_backward(grads[0], x, list(acts), list(tensors),
                                        *ctx.layout, need), tuple(need))
    return (got[0], *(None,) * len(ctx.layout), got[1:])


variant_block.register_autograd(_variant_autograd, setup_context=_variant_setup)


@torch.library.custom_op("tinylm::block_inference", mutates_args=(),
                         schema=f"(Tensor x, {_LAYOUT_ARGS}, Tensor[] tensors) -> Tensor")
def block_inference(x: Tensor, n_head: int, n_kv_head: int, norm: str, mlp: str,
                    eps1: float, eps2: float, qk_eps: float, tensors: list[Tensor | None]
                    ) -> Tensor:
    """:func:`tinylm.native.variants.block_inference` (evaluation: no gradients)."""
    return variants.block_inference(_lib(), _layout(n_head, n_kv_head, norm, mlp, eps1,
                                                    eps2, qk_eps), x,
                                    *_present(tensors).values())


@block_inference.register_fake
def _block_inference_fake(x, n_head, n_kv_head, norm, mlp, eps1, eps2, qk_eps, tensors):
    return x.new_empty(x.shape)


# --- tinylm::attention and tinylm::ffn: the paths of a block that is not fused ------------


@torch.library.custom_op(
    "tinylm::attention", mutates_args=(),
    schema="(Tensor x, Tensor w_qkv, Tensor? b_qkv, Tensor w_out, Tensor? b_out, "
           "int n_head) -> (Tensor, Tensor, Tensor, Tensor)")
def attention(x: Tensor, w_qkv: Tensor, b_qkv: Tensor | None, w_out: Tensor,
              b_out: Tensor | None, n_head: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, qkv, r, lse) of :func:`tinylm.native.functions.attention_forward`."""
    return functions.attention_forward(_lib(), x, w_qkv, b_qkv, w_out, b_out, n_head)


@attention.register_fake
def _attention_fake(x, w_qkv, b_qkv, w_out, b_out, n_head):
    B, C, _E = x.shape
    return (x.new_empty(B, C, w_out.shape[0]), x.new_empty(B, C, w_qkv.shape[0]),
            x.new_empty(B, C, w_out.shape[1]), x.new_empty(B, n_head, C))


@torch.library.custom_op(
    "tinylm::attention_backward", mutates_args=(),
    schema="(Tensor grad_y, Tensor x, Tensor w_qkv, Tensor qkv, Tensor r, Tensor lse, "
           "Tensor w_out, int n_head, bool[] need) -> Tensor[]")
def attention_backward(grad_y: Tensor, x: Tensor, w_qkv: Tensor, qkv: Tensor, r: Tensor,
                       lse: Tensor, w_out: Tensor, n_head: int, need: list[bool]
                       ) -> list[Tensor]:
    """The gradients of (x, w_qkv, b_qkv, w_out, b_out)
    (:func:`tinylm.native.functions.attention_backward`)."""
    return _grads(functions.attention_backward(_lib(), grad_y, x, w_qkv, qkv, r, lse, w_out,
                                               n_head, tuple(need)), x)


@attention_backward.register_fake
def _attention_backward_fake(grad_y, x, w_qkv, qkv, r, lse, w_out, n_head, need):
    shapes = (tuple(x.shape), tuple(w_qkv.shape), (w_qkv.shape[0],), tuple(w_out.shape),
              (w_out.shape[0],))
    return [x.new_empty(s if n else _EMPTY) for s, n in zip(shapes, need, strict=True)]


def _attention_setup(ctx, inputs, output) -> None:
    x, w_qkv, _b_qkv, w_out, _b_out, n_head = inputs
    _y, qkv, r, lse = output
    ctx.save_for_backward(x, w_qkv, qkv, r, lse, w_out)
    ctx.n_head = n_head


def _attention_autograd(ctx, grad_y, *_rest) -> tuple[Tensor | None, ...]:
    need = tuple(ctx.needs_input_grad[:5])
    got = attention_backward(grad_y, *ctx.saved_tensors, ctx.n_head, list(need))
    return (*_nones(got, need), None)


attention.register_autograd(_attention_autograd, setup_context=_attention_setup)


@torch.library.custom_op(
    "tinylm::ffn", mutates_args=(),
    schema="(Tensor x, Tensor w_up, Tensor? b_up, Tensor w_down, Tensor? b_down) "
           "-> (Tensor, Tensor)")
def ffn(x: Tensor, w_up: Tensor, b_up: Tensor | None, w_down: Tensor, b_down: Tensor | None
        ) -> tuple[Tensor, Tensor]:
    """(y, h) of :func:`tinylm.native.functions.ffn_forward` on the native kernels."""
    return functions.ffn_forward(_lib(), x, w_up, b_up, w_down, b_down)


@ffn.register_fake
def _ffn_fake(x, w_up, b_up, w_down, b_down):
    N = x.numel() // x.shape[-1]
    return x.new_empty(*x.shape[:-1], w_down.shape[0]), x.new_empty(N, w_up.shape[0])


@torch.library.custom_op(
    "tinylm::ffn_backward", mutates_args=(),
    schema="(Tensor grad_y, Tensor x, Tensor h, Tensor w_up, Tensor w_down, bool[] need) "
           "-> Tensor[]")
def ffn_backward(grad_y: Tensor, x: Tensor, h: Tensor, w_up: Tensor, w_down: Tensor,
                 need: list[bool]) -> list[Tensor]:
    """The gradients of (x, w_up, b_up, w_down, b_down)
    (:func:`tinylm.native.functions.ffn_step_backward`)."""
    return _grads(functions.ffn_step_backward(_lib(), grad_y, x, h, w_up, w_down,
                                              tuple(need)), x)


@ffn_backward.register_fake
def _ffn_backward_fake(grad_y, x, h, w_up, w_down, need):
    shapes = (tuple(x.shape), tuple(w_up.shape), (w_up.shape[0],), tuple(w_down.shape),
              (w_down.shape[0],))
    return [x.new_empty(s if n else _EMPTY) for s, n in zip(shapes, need, strict=True)]


def _ffn_setup(ctx, inputs, output) -> None:
    x, w_up, _b_up, w_down, _b_down = inputs
    ctx.save_for_backward(x, output[1], w_up, w_down)


def _ffn_autograd(ctx, grad_y, _grad_h) -> tuple[Tensor | None, ...]:
    need = tuple(ctx.needs_input_grad[:5])
    return tuple(_nones(ffn_backward(grad_y, *ctx.saved_tensors, list(need)), need))


ffn.register_autograd(_ffn_autograd, setup_context=_ffn_setup)

#: Every op of this module with its backward op (None: not differentiated).
OPS = {"block": block_backward, "variant_block": variant_block_backward,
       "block_inference": None, "attention": attention_backward, "ffn": ffn_backward}
