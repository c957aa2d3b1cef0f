"""The native ops, checked: every call validates its tensors before a pointer is passed.

:func:`load` builds and loads the library once per process (:mod:`tinylm.native.build`),
runs the self-check (:mod:`tinylm.native.selfcheck`) and returns a :class:`Library`, or
None where the kernels cannot be used. It is called at explicit points only
(``tinylm.native.accelerate``, the decoding plan); forwards use :func:`loaded`, which
never compiles.

The ctypes signatures are read from the ``TL_API`` declarations of ``csrc/tinylm.h``:
the C header is the one place a signature is written. Every method of :class:`Library`
checks dtype (float32, int64 for ids), device (CPU), contiguity and shapes and raises
:class:`OpError` otherwise, so no call reads memory a tensor does not own.

The switch: ``TINYLM_NATIVE=0`` in the environment, or ``with tinylm.native.disabled():``,
turns every fast path off (:func:`enabled`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from tinylm.layers.blocks import TYPES as BLOCK_TYPES
from tinylm.native import build, selfcheck

log = logging.getLogger("tinylm.native")

HEADER = build.SOURCES / "tinylm.h"
ATTENTION_MAX_CONTEXT = 256  # the training attention holds a head's (C, C) map per thread
MAX_ROWS = 16  # the packed linear serves at most this many rows (a decoding step)
_NOMEM = 1


class PackedQ8(NamedTuple):
    """An int8 weight packed by :meth:`Library.pack_q8`: integers, scales, the group size
    and the (O, I) shape they came from."""

    qweight: Tensor
    scale: Tensor
    group_size: int
    out_features: int
    in_features: int


class PackedBlocks(NamedTuple):
    """GGUF blocks packed by :meth:`Library.pack_blocks`: the panels (uint8), the GGML type
    id and the (O, I) shape they came from."""

    data: Tensor
    type_id: int
    out_features: int
    in_features: int


class OpError(ValueError):
    """A native op was given tensors it cannot take (wrong dtype, device, layout, shape)."""


# --- the one declaration of every signature -------------------------------------------------

_C_TYPES = {"void": None, "int": ctypes.c_int, "long": ctypes.c_long, "float": ctypes.c_float}
_DECL = re.compile(r"TL_API\s+(\w+)\s*(\*?)\s*(\w+)\s*\(([^)]*)\)\s*;", re.S)


def parse_header(text: str) -> dict[str, tuple[object, list[object]]]:
    """``{name: (restype, argtypes)}`` from the TL_API declarations of a C header: pointers
    (returned or passed) become ``c_void_p``, ``long``/``int``/``float`` their ctypes types."""
    out = {}
    for ret, star, name, params in _DECL.findall(text):
        args = []
        for param in params.split(","):
            words = param.replace("*", " * ").split()
            if "*" in words:
                args.append(ctypes.c_void_p)
            else:
                args.append(_C_TYPES[words[-2]])
        out[name] = (ctypes.c_void_p if star else _C_TYPES[ret], args)
    return out


@functools.cache
def header_constant(name: str, header: Path = HEADER) -> int:
    """The integer ``#define NAME <number>`` of the C header (a layout shared with C),
    read once per process."""
    match = re.search(rf"^#define\s+{name}\s+(\d+)\b", header.read_text(), re.M)
    if match is None:
        raise KeyError(f"{header.name} defines no integer {name}")
    return int(match.group(1))


def bind(cdll: ctypes.CDLL, header: Path = HEADER) -> ctypes.CDLL:
    for name, (restype, argtypes) in parse_header(header.read_text()).items():
        fn = getattr(cdll, name)
        fn.restype, fn.argtypes = restype, argtypes
    return cdll


# --- checks ---------------------------------------------------------------------------------


def check(name: str, t: Tensor, shape: tuple[int, ...] | None = None, *,
          dtype: torch.dtype = torch.float32, contiguous: bool = True) -> int:
    """Raise OpError unless ``t`` is a CPU tensor of ``dtype`` (contiguous, of ``shape``
    where given; -1 matches any size); returns its data pointer. The common case (all
    fine) is tested first, in few attribute reads (an exact shape by one comparison): a
    decoding step calls this per op, a training block ~35 times."""
    if isinstance(t, Tensor) and t.is_cpu and t.dtype == dtype \
            and (not contiguous or t.is_contiguous()) \
            and (shape is None or t.shape == shape or _shape_fits(t.shape, shape)):
        return t.data_ptr()
    if not isinstance(t, Tensor):
        raise OpError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise OpError(f"{name} must be on the CPU, got {t.device}")
    if t.dtype != dtype:
        raise OpError(f"{name} must be {dtype}, got {t.dtype}")
    if contiguous and not t.is_contiguous():
        raise OpError(f"{name} must be contiguous")
    if shape is not None and (t.dim() != len(shape) or any(
            want not in (-1, got) for want, got in zip(shape, t.shape, strict=True))):
        raise OpError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    return t.data_ptr()


def _shape_fits(got: tuple[int, ...], want: tuple[int, ...]) -> bool:
    if len(got) != len(want):
        return False
    for w, g in zip(want, got, strict=True):
        if w != -1 and w != g:
            return False
    return True


def _opt(name: str, t: Tensor | None, shape: tuple[int, ...]) -> int | None:
    return None if t is None else check(name, t, shape)


def _out(out: Tensor | None, shape: tuple[int, ...] | torch.Size) -> Tensor:
    """``out`` (checked: float32, contiguous, of ``shape``) or a new tensor of that shape."""
    if out is None:
        return torch.empty(shape)
    check("out", out, tuple(shape))
    return out


def _ok(code: int, op: str) -> None:
    if code == _NOMEM:
        raise MemoryError(f"native {op}: out of memory")


_work = threading.local()


def _workspace(n: int) -> Tensor:
    """A float32 buffer of at least ``n`` elements, this thread's, reused from call to call
    (a fresh one per product would be memory mapped anew, page by page, each step)."""
    buf = getattr(_work, "buffer", None)
    if buf is None or buf.numel() < n:
        buf = _work.buffer = torch.empty(n)
    return buf


def _threads() -> int:
    return torch.get_num_threads()


class Library:
    """The loaded kernels, one checked method per op (see csrc/ for the math)."""

    def __init__(self, cdll: ctypes.CDLL) -> None:
        self.raw = bind(cdll)  # unchecked, for callers that checked their buffers once
        #: the columns of csrc/gemm.c's panels (its work for one panel of one k)
        self.gemm_width = self.raw.tl_gemm_work(1, 1, 1)

    def pack(self, weight: Tensor) -> Tensor:
        """The panel-packed copy of a (O, I) weight for :meth:`linear`."""
        w = weight.detach().contiguous()
        check("weight", w, (-1, -1))
        O, I = w.shape
        out = torch.empty(self.raw.tl_packed_size(O, I), dtype=torch.float32)
        self.raw.tl_pack(w.data_ptr(), out.data_ptr(), O, I, _threads())
        return out

    def linear(self, x: Tensor, packed: Tensor, bias: Tensor | None, out_features: int
               ) -> Tensor:
        """x (M, I) -> x·Wᵀ + b (M, O), W given by :meth:`pack`."""
        M, I = x.shape if x.dim() == 2 else (0, 0)
        check("x", x, (-1, -1))
        check("packed", packed, (self.raw.tl_packed_size(out_features, I),))
        b = _opt("bias", bias, (out_features,))
        y = torch.empty(M, out_features)
        self.raw.tl_linear(x.data_ptr(), I, packed.data_ptr(), b, y.data_ptr(), M, I,
                           out_features, _threads(), 0, None)
        return y

    def pack_q8(self, qweight: Tensor, scale: Tensor, group_size: int) -> PackedQ8:
        """The panel-packed copy of int8 q (O, I) and float32 scales s (O, ceil(I / G)),
        each scale over G = ``group_size`` input features, for :meth:`linear_q8_packed`."""
        check("qweight", qweight, (-1, -1), dtype=torch.int8)
        O, I = qweight.shape
        if not 1 <= group_size <= max(I, 1):
            raise OpError(f"group size must be in [1, {max(I, 1)}], got {group_size}")
        check("scale", scale, (O, -(-I // group_size)))
        qp = torch.empty(self.raw.tl_q8_packed_size(O, I), dtype=torch.int8)
        sp = torch.empty(self.raw.tl_q8_scales_size(O, I, group_size))
        self.raw.tl_q8_pack(qweight.data_ptr(), scale.data_ptr(), group_size, qp.data_ptr(),
                            sp.data_ptr(), O, I, _threads())
        return PackedQ8(qp, sp, group_size, O, I)

    def linear_q8_packed(self, x: Tensor, packed: PackedQ8, bias: Tensor | None,
                         act: int = 0, res: Tensor | None = None) -> Tensor:
        """x (M, I) -> act(x·(q·s)ᵀ + b) (+ res), (M, O), q and s given by :meth:`pack_q8`."""
        qp, sp, G, O, I = packed
        check("x", x, (-1, I))
        check("qpacked", qp, (self.raw.tl_q8_packed_size(O, I),), dtype=torch.int8)
        check("spacked", sp, (self.raw.tl_q8_scales_size(O, I, G),))
        M = x.shape[0]
        b = _opt("bias", bias, (O,))
        r = _opt("res", res, (M, O))
        y = torch.empty(M, O)
        self.raw.tl_linear_q8(x.data_ptr(), I, qp.data_ptr(), sp.data_ptr(), G, b,
                              y.data_ptr(), M, I, O, _threads(), int(bool(act)), r)
        return y

    def linear_q8(self, x: Tensor, qweight: Tensor, scale: Tensor, group_size: int,
                  bias: Tensor | None, act: int = 0, res: Tensor | None = None) -> Tensor:
        """x (M, I) -> act(x·(q·s)ᵀ + b) (+ res), (M, O), from int8 q (O, I) and float32
        scales s (O, ceil(I / G)), each over G = ``group_size`` input features (packed
        for this one call: a decoder packs once, :meth:`pack_q8`)."""
        check("x", x, (-1, -1))
        check("qweight", qweight, (-1, x.shape[1]), dtype=torch.int8)
        return self.linear_q8_packed(x, self.pack_q8(qweight, scale, group_size), bias, act,
                                     res)

    def pack_blocks(self, blocks: Tensor, block_type: str, in_features: int) -> PackedBlocks:
        """The panel copy (csrc/blocks.c: 16 rows per panel, the same codes and fp16
        scales, moved) of GGUF blocks (O, ceil(I/32)·bytes) uint8 of ``block_type``
        (tinylm.layers.blocks: Q4_0, Q4_1, Q8_0), for :meth:`linear_blocks_packed`."""
        type_id, size = BLOCK_TYPES[block_type]
        if in_features < 1:
            raise OpError("a block layer needs at least one input feature")
        check("blocks", blocks, (-1, -(-in_features // 32) * size), dtype=torch.uint8)
        O = blocks.shape[0]
        out = torch.empty(self.raw.tl_blocks_packed_size(type_id, O, in_features),
                          dtype=torch.uint8)
        self.raw.tl_blocks_pack(blocks.data_ptr(), type_id, out.data_ptr(), O, in_features,
                                _threads())
        return PackedBlocks(out, type_id, O, in_features)

    def linear_blocks_packed(self, x: Tensor, packed: PackedBlocks, bias: Tensor | None,
                             act: int = 0, res: Tensor | None = None) -> Tensor:
        """x (M, I) -> act(x·Wᵀ + b) (+ res), (M, O), W given by :meth:`pack_blocks`; x is
        quantized per block of 32 (csrc/blocks.c)."""
        data, type_id, O, I = packed
        check("x", x, (-1, I))
        check("packed", data, (self.raw.tl_blocks_packed_size(type_id, O, I),),
              dtype=torch.uint8)
        M = x.shape[0]
        b = _opt("bias", bias, (O,))
        r = _opt("res", res, (M, O))
        y = torch.empty(M, O)
        self.raw.tl_linear_blocks(x.data_ptr(), I, data.data_ptr(), type_id, b, y.data_ptr(),
                                  M, I, O, _threads(), int(bool(act)), r)
        return y

    def linear_blocks(self, x: Tensor, blocks: Tensor, block_type: str, bias: Tensor | None,
                      act: int = 0, res: Tensor | None = None) -> Tensor:
        """:meth:`linear_blocks_packed` of GGUF blocks packed for this one call (a decoder
        packs once)."""
        check("x", x, (-1, -1))
        return self.linear_blocks_packed(x, self.pack_blocks(blocks, block_type, x.shape[1]),
                                         bias, act, res)

    def argmax(self, x: Tensor) -> Tensor:
        """x (B, V), unit stride along V -> the first index of each row's maximum (B,)."""
        if x.dim() != 2 or x.shape[1] == 0 or x.stride(1) != 1:
            raise OpError(f"argmax needs (B, V > 0) rows of unit stride, got {tuple(x.shape)}")
        check("logits", x, contiguous=False)
        out = torch.empty(x.shape[0], dtype=torch.int64)
        self.raw.tl_argmax(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                           _threads())
        return out

    def attend_one(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                   pos: int, scratch: Tensor) -> Tensor:
        """Write k, v (B, H, 1, D) at ``pos`` of one layer's cache (B, H, max_len, D), then
        attend q (B, H, 1, D) over positions 0..pos -> (B, H, 1, D)."""
        B, H, _, D = q.shape
        for name, t in (("q", q), ("k", k), ("v", v)):
            check(name, t, (B, H, 1, D), contiguous=False)
            if t.stride(-1) != 1:
                raise OpError(f"{name} must have a unit stride along D")
        for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
            check(name, t, (B, H, -1, D), contiguous=False)
            if t.stride(-1) != 1 or t.stride(-2) != D:
                raise OpError(f"{name} must be (B, H, max_len, D) with contiguous rows")
        if k_cache.stride() != v_cache.stride() or not 0 <= pos < k_cache.shape[2]:
            raise OpError(f"position {pos} is outside the cache of {k_cache.shape[2]}")
        check("scratch", scratch, (-1,))
        if scratch.numel() < B * H * (pos + 1):
            raise OpError(f"scratch needs {B * H * (pos + 1)} floats")
        out = torch.empty(B, 1, H, D)
        self.raw.tl_attend_one(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(),
                               k.stride(0), k.stride(1), v.data_ptr(), v.stride(0), v.stride(1),
                               k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                               k_cache.stride(1), B, H, D, pos, 1.0 / math.sqrt(D),
                               out.data_ptr(), scratch.data_ptr(), _threads())
        return out.transpose(1, 2)  # (B, 1, H, D) -> (B, H, 1, D)

    def embed(self, ids: Tensor, tok: Tensor, pos: Tensor, position: int) -> Tensor:
        """tok[ids] + pos[position] for ids (B,) -> (B, E); ids checked to be in range."""
        V, E = tok.shape
        check("ids", ids, (-1,), dtype=torch.int64)
        check("tok", tok, (V, E))
        check("pos", pos, (-1, E))
        if not 0 <= position < pos.shape[0]:
            raise OpError(f"position {position} is outside [0, {pos.shape[0]})")
        x = torch.empty(ids.shape[0], E)
        if self.raw.tl_embed(ids.data_ptr(), tok.data_ptr(), pos.data_ptr(), position,
                             x.data_ptr(), ids.shape[0], E, V):
            raise ValueError(f"token ids must be in [0, {V}), got {ids.tolist()}")
        return x

    def matmul(self, a: Tensor, b: Tensor, *, a_t: bool = False, b_t: bool = False,
               out: Tensor | None = None, accumulate: bool = False) -> Tensor:
        """op(a)·op(b) for 2-D float32 a, b: a (M, K), or (K, M) used transposed (``a_t``,
        a weight gradient Gᵀ·X); b (K, N), or a weight (N, K) used transposed (``b_t``,
        x·Wᵀ); not both. Into ``out`` (M, N) if given, added to it where ``accumulate``,
        else a new tensor (csrc/gemm.c)."""
        if a_t and b_t:
            raise OpError("matmul takes a transposed a or a transposed b, not both")
        check("a", a, (-1, -1))
        check("b", b, (-1, -1))
        (K, M), (N, Kb) = (a.shape if a_t else a.shape[::-1]), \
            (b.shape if b_t else b.shape[::-1])
        if Kb != K:
            raise OpError(f"matmul: inner sizes differ ({K} and {Kb})")
        if accumulate and out is None:
            raise OpError("matmul: accumulate needs an out tensor")
        c = _out(out, (M, N))
        nr = self.gemm_width  # the work buffer: panels of W, or b's last, partial panel
        n = -(-N // nr) * K * nr if b_t else (K * nr if N % nr else 0)
        work = _workspace(n).data_ptr() if n else None
        self.raw.tl_gemm(M, N, K, a.data_ptr(), 1 if a_t else K, M if a_t else 1,
                         b.data_ptr(), K if b_t else N, int(b_t), c.data_ptr(), N,
                         int(accumulate), work, _threads())
        return c

    def block_train_forward(self, x: Tensor, n_head: int, eps1: float, eps2: float,
                            params: tuple[Tensor | None, ...], act: Tensor
                            ) -> tuple[Tensor, tuple[Tensor, ...]]:
        """A GPT-2 block's forward for training in one native call (csrc/train_block.c):
        x (B, C, E), ``params`` (ln1_w, ln1_b, w_qkv, b_qkv, w_out, b_out, ln2_w, ln2_b,
        w_up, b_up, w_down, b_down; None where absent) -> (y (B, C, E), the activations
        of :data:`tinylm.native.functions.BLOCK_SAVED`). ``act`` (B·C, F) is scratch."""
        p = dict(zip(BLOCK_PARAMS, params, strict=True))
        B, C, E, H, D, F = _block_sizes(x, n_head, p)
        N = B * C
        acts = {name: torch.empty(shape)
                for name, shape in _block_act_shapes(B, C, E, H, D, F).items()}
        y = torch.empty(B, C, E)
        check("act", act, (N, F))
        work = _workspace(self.raw.tl_block_work(N, E, H * D, F))
        slots = _block_slots(p, x=x, y=y, s_act=act, work=work, **acts)
        _ok(self.raw.tl_block_fwd(slots.data_ptr(), B, C, E, H, D, F, eps1, eps2, D**-0.5,
                                  _threads()), "block_train_forward")
        return y, tuple(acts.values())

    def block_train_backward(self, grad_y: Tensor, x: Tensor, acts: tuple[Tensor, ...],
                             weights: dict[str, Tensor | None], n_head: int,
                             want: tuple[bool, ...], scratch: dict[str, Tensor]
                             ) -> tuple[Tensor | None, ...]:
        """The backward of :meth:`block_train_forward` from dL/dy: (dL/dx, then the
        gradient of each of :data:`BLOCK_PARAMS` where ``want`` says so, else None).
        ``weights``: ln1_w, w_qkv, w_out, ln2_w, w_up, w_down by name (the norms' may be
        None). ``scratch``: s_grad, s_act (B·C, F), s_attn (B·C, H·D), s_qkv
        (B·C, 3·H·D), s_t1, s_gx1 (B·C, E), all dead on return."""
        B, C, E, H, D, F = _block_sizes(x, n_head, weights)
        N, shapes = B * C, _block_param_shapes(E, H * D, F)
        grad_y = grad_y.contiguous()
        check("grad_y", grad_y, (B, C, E))
        for (name, shape), t in zip(_block_act_shapes(B, C, E, H, D, F).items(), acts,
                                    strict=True):
            check(name, t, shape)
        for name, shape in (("s_grad", (N, F)), ("s_act", (N, F)), ("s_attn", (N, H * D)),
                            ("s_qkv", (N, 3 * H * D)), ("s_t1", (N, E)), ("s_gx1", (N, E))):
            check(name, scratch[name], shape)
        grads = {"g_" + name: torch.empty(shapes[name]) if w else None
                 for name, w in zip(BLOCK_PARAMS, want, strict=True)}
        gx = torch.empty(B, C, E)
        slots = _block_slots(weights, x=x, gy=grad_y, gx=gx, **grads, **scratch,
                             **dict(zip(BLOCK_SAVED, acts, strict=True)),
                             work=_workspace(self.raw.tl_block_work(N, E, H * D, F)))
        _ok(self.raw.tl_block_bwd(slots.data_ptr(), B, C, E, H, D, F, D**-0.5, _threads()),
            "block_train_backward")
        return (gx, *grads.values())

    def bias_gelu_(self, a: Tensor, bias: Tensor | None, out: Tensor | None = None
                   ) -> Tensor:
        """``a += bias`` in place (a (..., N)), then GELU_tanh(a) as a new tensor (or
        into ``out``, of a's shape)."""
        N = a.shape[-1]
        check("a", a)
        b = _opt("bias", bias, (N,))
        g = torch.empty_like(a) if out is None else out
        check("out", g, tuple(a.shape))
        self.raw.tl_bias_gelu(a.data_ptr(), b, g.data_ptr(), a.numel() // N if N else 0, N,
                              _threads())
        return g

    def gelu_backward(self, grad: Tensor, x: Tensor, sum_rows: bool,
                      out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """(dL/dx written over ``grad``, GELU(x) (into ``out`` if given), Σ_rows dL/dx
        or None)."""
        N = x.shape[-1]
        check("x", x)
        check("grad", grad, tuple(x.shape))
        y = torch.empty_like(x) if out is None else out
        check("out", y, tuple(x.shape))
        colsum = torch.empty(N) if sum_rows else None
        self.raw.tl_gelu_backward(x.data_ptr(), grad.data_ptr(), y.data_ptr(),
                                  colsum.data_ptr() if colsum is not None else None,
                                  x.numel() // N if N else 0, N, _threads())
        return grad, y, colsum

    def layer_norm(self, x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float,
                   out: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """F.layer_norm over the last dim of x (..., E) (into ``out``, of x's shape, if
        given), with each row's mean and 1/std."""
        E = x.shape[-1]
        M = x.numel() // E
        check("x", x)
        w, b = _opt("weight", weight, (E,)), _opt("bias", bias, (E,))
        y, mean, rstd = _out(out, x.shape), torch.empty(M), torch.empty(M)
        self.raw.tl_ln_fwd(x.data_ptr(), w, b, y.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
                           M, E, eps, _threads())
        return y, mean, rstd

    def layer_norm_residual(self, x: Tensor, weight: Tensor | None, bias: Tensor | None,
                            eps: float, residual_bias: Tensor | None
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """:meth:`layer_norm` of x (M, E), and x + ``residual_bias`` (E,; None: a copy
        of x) from the same pass: the start of the residual sum around the norm's
        branch, into which the branch's last product accumulates."""
        E = x.shape[-1]
        M = x.numel() // E
        check("x", x, (-1, E))
        w, b = _opt("weight", weight, (E,)), _opt("bias", bias, (E,))
        rb = _opt("residual_bias", residual_bias, (E,))
        y, mean, rstd, res = torch.empty_like(x), torch.empty(M), torch.empty(M), \
            torch.empty_like(x)
        self.raw.tl_ln_fwd_res(x.data_ptr(), w, b, y.data_ptr(), mean.data_ptr(),
                               rstd.data_ptr(), rb, res.data_ptr(), M, E, eps, _threads())
        return y, mean, rstd, res

    def layer_norm_backward(self, grad_y: Tensor, x: Tensor, weight: Tensor | None,
                            mean: Tensor, rstd: Tensor, need_weight: bool, need_bias: bool,
                            residual: Tensor | None = None, residual_sum: Tensor | None = None
                            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(dL/dx, dL/dweight or None, dL/dbias or None) of :meth:`layer_norm`; a
        ``residual`` (x's shape: the gradient of a residual path around the norm) is
        added to dL/dx in the same pass, and summed over the rows into ``residual_sum``
        (E,) where given (the gradient of a bias added on that path)."""
        E = x.shape[-1]
        M = x.numel() // E
        check("x", x)
        grad_y = grad_y.contiguous()
        check("grad_y", grad_y, tuple(x.shape))
        check("mean", mean, (M,))
        check("rstd", rstd, (M,))
        w = _opt("weight", weight, (E,))
        res = _opt("residual", residual, tuple(x.shape))
        if residual_sum is not None and residual is None:
            raise OpError("residual_sum needs a residual")
        rsum = _opt("residual_sum", residual_sum, (E,))
        dx = torch.empty_like(x)
        dw = torch.empty(E) if need_weight else None
        db = torch.empty(E) if need_bias else None
        _ok(self.raw.tl_ln_bwd(x.data_ptr(), w, mean.data_ptr(), rstd.data_ptr(),
                               grad_y.data_ptr(), res, dx.data_ptr(),
                               dw.data_ptr() if dw is not None else None,
                               db.data_ptr() if db is not None else None, rsum, M, E,
                               _threads()),
            "layer_norm_backward")
        return dx, dw, db

    def rms_norm(self, x: Tensor, weight: Tensor | None, eps: float,
                 out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """RMSNorm over the last dim of x (..., E): (x·rs·weight (into ``out``, of x's
        shape, if given), rs (M,)) with rs = (mean(x²) + eps)^(-1/2) per row."""
        E = x.shape[-1]
        M = x.numel() // E
        check("x", x)
        w = _opt("weight", weight, (E,))
        y, rs = _out(out, x.shape), torch.empty(M)
        self.raw.tl_rms_fwd(x.data_ptr(), w, y.data_ptr(), rs.data_ptr(), M, E, eps, _threads())
        return y, rs

    def rms_norm_backward(self, grad_y: Tensor, x: Tensor, weight: Tensor | None, rs: Tensor,
                          need_weight: bool, residual: Tensor | None = None
                          ) -> tuple[Tensor, Tensor | None]:
        """(dL/dx (+ ``residual``, x's shape, in the same pass), dL/dweight or None) of
        :meth:`rms_norm`."""
        E = x.shape[-1]
        M = x.numel() // E
        check("x", x)
        grad_y = grad_y.contiguous()
        check("grad_y", grad_y, tuple(x.shape))
        check("rs", rs, (M,))
        w = _opt("weight", weight, (E,))
        res = _opt("residual", residual, tuple(x.shape))
        dx = torch.empty_like(x)
        dw = torch.empty(E) if need_weight and weight is not None else None
        self.raw.tl_rms_bwd(x.data_ptr(), w, rs.data_ptr(), grad_y.data_ptr(), res,
                            dx.data_ptr(), dw.data_ptr() if dw is not None else None, M, E,
                            _threads())
        return dx, dw

    def qk_rope(self, qkv: Tensor, n_head: int, n_kv_head: int, q_gain: Tensor | None,
                k_gain: Tensor | None, cos: Tensor | None, sin: Tensor | None, eps: float,
                out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The attention kernel's input (B, C, 3·H·D) from qkv (B, C, (H + 2·H_kv)·D):
        RoPE(QKNorm(q)), then k (likewise) and v with each key/value head repeated for
        its H / H_kv query heads; and QK-norm's 1/RMS per head (B, C, H + H_kv).
        ``q_gain``/``k_gain`` (D,) None: no QK-norm; ``cos``/``sin`` (C, 1, D) as
        :func:`tinylm.native.variants.rope_tables` makes them, None: no rotation. The
        input goes into ``out`` if given."""
        B, C, H, Hkv, D = _qk_shape(qkv, n_head, n_kv_head)
        check("qkv", qkv)
        norm, qw, kw = _qk_gains(q_gain, k_gain, D)
        c, s = _rope_pointers(cos, sin, C, D)
        out, rs = _out(out, (B, C, 3 * H * D)), torch.empty(B, C, H + Hkv)
        _ok(self.raw.tl_qk_fwd(qkv.data_ptr(), qw, kw, c, s, out.data_ptr(), rs.data_ptr(),
                               B * C, C, H, Hkv, D, eps, int(norm), _threads()), "qk_rope")
        return out, rs

    def qk_rope_backward(self, grad_out: Tensor, qkv: Tensor, n_head: int, n_kv_head: int,
                         q_gain: Tensor | None, k_gain: Tensor | None, rs: Tensor,
                         cos: Tensor | None, sin: Tensor | None, need_gains: bool
                         ) -> tuple[Tensor, Tensor | None]:
        """(dL/dqkv (B, C, (H + 2·H_kv)·D), the q and k gains' gradients as one (2, D)
        tensor or None) of :meth:`qk_rope`, from dL/d(its output) (B, C, 3·H·D)."""
        B, C, H, Hkv, D = _qk_shape(qkv, n_head, n_kv_head)
        check("qkv", qkv)
        grad_out = grad_out.contiguous()
        check("grad_out", grad_out, (B, C, 3 * H * D))
        check("rs", rs, (B, C, H + Hkv))
        norm, qw, kw = _qk_gains(q_gain, k_gain, D)
        c, s = _rope_pointers(cos, sin, C, D)
        grad_qkv = torch.empty_like(qkv)
        dw = torch.empty(2, D) if norm and need_gains else None
        _ok(self.raw.tl_qk_bwd(grad_out.data_ptr(), qkv.data_ptr(), qw, kw, rs.data_ptr(), c,
                               s, grad_qkv.data_ptr(),
                               dw.data_ptr() if dw is not None else None, B * C, C, H, Hkv,
                               D, int(norm), _threads()), "qk_rope_backward")
        return grad_qkv, dw

    def rope_heads(self, x: Tensor, n_heads: int, gain: Tensor | None, cos: Tensor | None,
                   sin_pm: Tensor | None, eps: float, tmp: Tensor) -> Tensor:
        """RoPE(QKNorm(head)) in place for the first ``n_heads`` heads of each row of x
        (B, W) (unit stride along W), all at one position (a decoding step): ``cos`` and
        ``sin_pm`` (D,) are its tables (sin± as :func:`tinylm.native.variants.signed_sin`
        makes it; None: no rotation), ``gain`` (D,) QK-norm's weight (None: no QK-norm).
        ``tmp``: at least D floats of scratch. Returns x."""
        sized = cos if cos is not None else gain
        if sized is None:  # neither a norm nor a rotation: nothing to do
            return x
        D = sized.shape[-1]
        check("x", x, contiguous=False)
        if x.dim() != 2 or x.stride(1) != 1 or not 0 < n_heads * D <= x.shape[1]:
            raise OpError(f"x must be (B, W >= {n_heads} heads of {D}) rows of unit stride, "
                          f"got {tuple(x.shape)}")
        w = _opt("gain", gain, (D,))
        c, s = _opt("cos", cos, (D,)), _opt("sin_pm", sin_pm, (D,))
        if (c is None) != (s is None):
            raise OpError("cos and sin_pm go together")
        check("tmp", tmp, (-1,))
        if tmp.numel() < D:
            raise OpError(f"tmp needs {D} floats")
        self.raw.tl_rope_heads(x.data_ptr(), x.stride(0), x.shape[0], n_heads, D, w, c, s, eps,
                               int(gain is not None), tmp.data_ptr())
        return x

    def relu2(self, h: Tensor, out: Tensor | None = None) -> Tensor:
        """relu(h)² as a new tensor (or into ``out``, of h's shape)."""
        check("h", h)
        g = _out(out, h.shape)
        self.raw.tl_relu2(h.data_ptr(), g.data_ptr(), h.numel(), _threads())
        return g

    def relu2_backward(self, grad: Tensor, h: Tensor, out: Tensor | None = None
                       ) -> tuple[Tensor, Tensor]:
        """(dL/dh = grad·2·relu(h), written over ``grad``; relu(h)² recomputed, into
        ``out`` if given)."""
        check("h", h)
        check("grad", grad, tuple(h.shape))
        y = torch.empty_like(h) if out is None else out
        check("out", y, tuple(h.shape))
        self.raw.tl_relu2_backward(h.data_ptr(), grad.data_ptr(), y.data_ptr(), h.numel(),
                                   _threads())
        return grad, y

    def causal_attention(self, qkv: Tensor, n_head: int, bias: Tensor | None = None,
                         out: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Causal attention of every head from qkv (B, C, 3·H·D), laid out (B, C, 3, H, D):
        -> (B, C, H·D) (into ``out`` if given) and each query's log-sum-exp (B, H, C).
        ``bias`` (3·H·D,) is first added to qkv in place."""
        B, C, H, D = attention_shape(qkv, n_head)
        b = None if bias is None else _opt("bias", bias.detach().contiguous(), (3 * H * D,))
        out, lse = _out(out, (B, C, H * D)), torch.empty(B, H, C)
        _ok(self.raw.tl_attn_fwd(qkv.data_ptr(), b, out.data_ptr(), lse.data_ptr(), B, C, H,
                                 D, D**-0.5, _threads()), "causal_attention")
        return out, lse

    def causal_attention_backward(self, grad_out: Tensor, qkv: Tensor, out: Tensor,
                                  lse: Tensor, n_head: int, *, bias_grad: bool = False,
                                  grad_qkv: Tensor | None = None
                                  ) -> tuple[Tensor, Tensor | None]:
        """dL/dqkv (B, C, 3·H·D) of :meth:`causal_attention` (and, with ``bias_grad``, its
        sum over the B·C rows: the bias's gradient), from dL/dout (B, C, H·D); written
        into ``grad_qkv`` if given."""
        B, C, H, D = attention_shape(qkv, n_head)
        grad_out = grad_out.contiguous()
        check("grad_out", grad_out, (B, C, H * D))
        check("out", out, (B, C, H * D))
        check("lse", lse, (B, H, C))
        grad_qkv = torch.empty_like(qkv) if grad_qkv is None else grad_qkv
        check("grad_qkv", grad_qkv, (B, C, 3 * H * D))
        grad_bias = torch.empty(3 * H * D) if bias_grad else None
        _ok(self.raw.tl_attn_bwd(qkv.data_ptr(), out.data_ptr(), grad_out.data_ptr(),
                                 lse.data_ptr(), grad_qkv.data_ptr(),
                                 grad_bias.data_ptr() if grad_bias is not None else None,
                                 B, C, H, D, D**-0.5, _threads()), "causal_attention_backward")
        return grad_qkv, grad_bias


#: A block's parameters, in the order of tinylm.native.functions.BlockFn's arguments.
BLOCK_PARAMS = ("ln1_w", "ln1_b", "w_qkv", "b_qkv", "w_out", "b_out", "ln2_w", "ln2_b",
                "w_up", "b_up", "w_down", "b_down")
#: The activations a block's forward keeps for its backward (functions.BLOCK_SAVED).
BLOCK_SAVED = ("mu1", "rs1", "a_in", "qkv", "r2", "lse", "x1", "mu2", "rs2", "f_in", "h")


@functools.cache
def block_slot(name: str) -> int:
    """The index of a tensor in csrc/train_block.c's address array (its BT_* slot)."""
    return header_constant("BT_" + ("R" if name == "r2" else name.upper()))


def _block_slots(params: dict[str, Tensor | None], **tensors: Tensor | None) -> Tensor:
    """The int64 address array of train_block.c: each tensor at its slot, 0 for None."""
    out = [0] * header_constant("BT_SLOTS")
    for name, t in (*params.items(), *tensors.items()):
        if t is not None:
            out[block_slot(name)] = t.data_ptr()
    return torch.tensor(out, dtype=torch.int64)


def _block_param_shapes(E: int, HD: int, F: int) -> dict[str, tuple[int, ...]]:
    return {"ln1_w": (E,), "ln1_b": (E,), "w_qkv": (3 * HD, E), "b_qkv": (3 * HD,),
            "w_out": (E, HD), "b_out": (E,), "ln2_w": (E,), "ln2_b": (E,),
            "w_up": (F, E), "b_up": (F,), "w_down": (E, F), "b_down": (E,)}


def _block_sizes(x: Tensor, n_head: int, params: dict[str, Tensor | None]
                 ) -> tuple[int, int, int, int, int, int]:
    """(B, C, E, H, D, F) of a block's input and parameters (by name: the weights
    w_qkv, w_out, w_up, w_down and any others given), each checked."""
    check("x", x, (-1, -1, -1))
    B, C, E = x.shape
    HD, F = params["w_out"].shape[-1], params["w_up"].shape[0]
    if n_head < 1 or HD % n_head or not attention_fits(C, n_head, HD // n_head):
        raise OpError(f"the native block takes C <= {ATTENTION_MAX_CONTEXT} and heads of a "
                      f"multiple of 16 wide, got C={C}, {HD} for {n_head} heads")
    shapes = _block_param_shapes(E, HD, F)
    for name, t in params.items():
        if t is not None or name.startswith("w_"):
            check(name, t, shapes[name])
    return B, C, E, n_head, HD // n_head, F


def _block_act_shapes(B: int, C: int, E: int, H: int, D: int, F: int
                      ) -> dict[str, tuple[int, ...]]:
    """The shape of each of :data:`BLOCK_SAVED`, in that order."""
    N = B * C
    return {"mu1": (N,), "rs1": (N,), "a_in": (N, E), "qkv": (B, C, 3 * H * D),
            "r2": (N, H * D), "lse": (B, H, C), "x1": (N, E), "mu2": (N,), "rs2": (N,),
            "f_in": (N, E), "h": (N, F)}


def attention_fits(context: int, n_head: int, head_dim: int) -> bool:
    """Whether the training attention kernel takes these sizes: head size a multiple of
    16 and 1 <= context <= ATTENTION_MAX_CONTEXT."""
    return head_dim % 16 == 0 and head_dim > 0 and n_head > 0 \
        and 0 < context <= ATTENTION_MAX_CONTEXT


def attention_shape(qkv: Tensor, n_head: int) -> tuple[int, int, int, int]:
    check("qkv", qkv, (-1, -1, -1))
    B, C, three_hd = qkv.shape
    if n_head < 1 or three_hd % (3 * n_head) or not attention_fits(C, n_head,
                                                                   three_hd // (3 * n_head)):
        raise OpError(f"causal attention takes (B, C <= {ATTENTION_MAX_CONTEXT}, 3·H·D) with "
                      f"D a multiple of 16, got {tuple(qkv.shape)} for {n_head} heads")
    return B, C, n_head, three_hd // (3 * n_head)


def _qk_shape(qkv: Tensor, n_head: int, n_kv_head: int) -> tuple[int, int, int, int, int]:
    """(B, C, H, H_kv, D) of a (B, C, (H + 2·H_kv)·D) qkv with an even D."""
    check("qkv", qkv, (-1, -1, -1))
    B, C, width = qkv.shape
    H, Hkv = n_head, n_kv_head
    if Hkv < 1 or H < 1 or H % Hkv or width % (H + 2 * Hkv) or (width // (H + 2 * Hkv)) % 2:
        raise OpError(f"qkv {tuple(qkv.shape)} is not (B, C, (H + 2·H_kv)·D) with an even D "
                      f"for {H} query and {Hkv} key/value heads")
    return B, C, H, Hkv, width // (H + 2 * Hkv)


def _qk_gains(q_gain: Tensor | None, k_gain: Tensor | None, D: int
              ) -> tuple[bool, int | None, int | None]:
    """(QK-norm on?, the q and k gains' (D,) pointers); q_gain None: no QK-norm."""
    if q_gain is None:
        return False, None, None
    if k_gain is None:
        raise OpError("k_gain must be given with q_gain")
    return True, check("q_gain", q_gain, (D,)), check("k_gain", k_gain, (D,))


def _rope_pointers(cos: Tensor | None, sin: Tensor | None, C: int, D: int
                   ) -> tuple[int | None, int | None]:
    """The (C, 1, D) rotary tables' pointers (both None: no rotation)."""
    if (cos is None) != (sin is None):
        raise OpError("cos and sin must be given together")
    if cos is None:
        return None, None
    return check("cos", cos, (C, 1, D)), check("sin", sin, (C, 1, D))


# --- the library of this process, and the switch -----------------------------------------

_lock = threading.Lock()
_library: Library | None = None
_tried = False
_bpe_library: Library | None = None  # load_bpe(): checked on the BPE case only
_bpe_tried = False
_off = threading.local()


def env_enabled() -> bool:
    return os.environ.get("TINYLM_NATIVE", "1") != "0"


def enabled() -> bool:
    """False under ``TINYLM_NATIVE=0`` or inside :func:`disabled`: no fast path runs."""
    return env_enabled() and not getattr(_off, "depth", 0)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within this block (in this thread) every fast path steps aside for the reference."""
    _off.depth = getattr(_off, "depth", 0) + 1
    try:
        yield
    finally:
        _off.depth -= 1


def _load(check: Callable[[Library], None] = selfcheck.run) -> Library | None:
    if sys.platform not in ("linux", "darwin") or sys.byteorder != "little":
        log.info("native kernels: not built on %s; using torch's kernels", sys.platform)
        return None
    try:
        cdll = build.load_library(build.SOURCES, build.cache_root(),
                                  lambda lib: check(Library(lib)))
    except build.NativeUnavailable as e:
        quiet = "no C compiler" in str(e)  # the usual state of a machine without one
        (log.info if quiet else log.warning)("native kernels unavailable: %s; using "
                                             "torch's kernels", e)
        return None
    return Library(cdll)


def load() -> Library | None:
    """The checked library, built and self-checked on the first call in this process;
    None where it cannot be used (said once) or under ``TINYLM_NATIVE=0``."""
    global _library, _tried
    if not env_enabled():
        return None
    with _lock:
        if not _tried:
            _tried = True
            _library = _load()
    return _library


def load_bpe() -> Library | None:
    """The library for the BPE encoder alone (prepare): the same build, self-checked on
    its BPE case only (about a millisecond, not the torch ops' second); the full
    :func:`load` still checks everything before any other op is used. A library that
    failed :func:`load`'s full check is not used for BPE either."""
    global _bpe_library, _bpe_tried
    if not env_enabled():
        return None
    if _tried:
        return _library
    with _lock:
        if not _bpe_tried:
            _bpe_tried = True
            _bpe_library = _load(selfcheck.run_bpe)
    return _bpe_library


def loaded() -> Library | None:
    """The library if :func:`load` has built it and the fast paths are on; never builds."""
    return _library if _library is not None and enabled() else None
