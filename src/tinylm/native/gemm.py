"""The matrix products of the native training steps on the CPU, on the fastest of three fp32
GEMMs: tinylm's own (csrc/gemm.c), oneDNN's and torch's ``mm`` (MKL).

A training step's products are skinny: a few hundred to a few thousand rows of
activations times weights of 128..1536 features. torch's CPU ``mm`` calls MKL, which
takes its generic code path on AMD CPUs and spends a good part of such a product outside
its inner kernel; its transposed products Gᵀ·X (the weight gradients) run ~20 % below
its others. oneDNN's fp32 linear (``torch.ops.mkldnn._linear_pointwise``, the op inductor
uses for linear layers when it freezes weights for CPU inference) is faster than MKL for
the large x·Wᵀ and G·W, but costs more than it gains on small ones (every product of a
4×128 B=12 step on oneDNN: 1.09× slower). tinylm's kernel is one register-blocked
broadcast-FMA loop for all three forms, called through ctypes with no dispatch
(``python benchmarks/gemm.py`` times the three side by side).

Under both ``"native"`` (the default where the native library is loaded) and
``"onednn"``, x·Wᵀ and G·W of at least :data:`MIN_WORK` multiply-adds go to oneDNN
where torch has it (at 2048 rows its blocking beats tinylm's kernel there); the rest,
weight gradients included, go to tinylm's kernel under "native" and to MKL under
"onednn" (the rule before tinylm had its kernel). ``"torch"``: MKL for all.

All compute IEEE fp32 products (no reduced-precision modes); they differ only in the
order of the sums, so a block's outputs agree within float32 rounding
(tests/test_gemm.py holds each product to float64, and a training step on each backend
to the reference model).

The choice is made once (:func:`selected`), or as ``TINYLM_GEMM=native`` (``onednn``,
``torch``) says; :func:`using` switches it for a block of code (tests, benchmarks).
Tensors that are not float32 on the CPU always take torch's ``mm``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from tinylm.core.errors import ConfigError
from tinylm.native import ops

BACKENDS = ("native", "onednn", "torch")
#: x·Wᵀ and G·W of at least this many multiply-adds (N·I·O) go to oneDNN; smaller ones to
#: tinylm's kernel ("native") or torch's mm ("onednn"): with every product on oneDNN a
#: 4×128 B=12 training step was 1.09× slower in-process, although single products of its
#: sizes time faster in isolation; 6×384's (≥ 3·10⁸) gain.
MIN_WORK = 1 << 27
_chosen: list[str] = []  # the backend in use, decided on first call


@functools.cache
def _available() -> bool:
    """Whether this torch has oneDNN's linear op on the CPU."""
    return torch.backends.mkldnn.is_available() and \
        hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _decide() -> str:
    asked = os.environ.get("TINYLM_GEMM", "").strip().lower()
    if asked and asked not in BACKENDS:
        raise ConfigError(f"TINYLM_GEMM={asked!r} is not a GEMM backend: set it to one of "
                          f"{', '.join(BACKENDS)}, or unset it")
    if asked:
        return asked
    return "native" if ops.loaded() is not None else "onednn" if _available() else "torch"


def selected() -> str:
    """The backend the native steps' products use: "native", "onednn" or "torch"."""
    if not _chosen:
        _chosen.append(_decide())
    return _chosen[0]


@contextmanager
def using(backend: str) -> Iterator[None]:
    """Run the block with ``backend`` ("onednn" needs a torch that has it)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM backend {backend!r}; use one of {', '.join(BACKENDS)}")
    if backend == "onednn" and not _available():
        raise RuntimeError("this torch has no oneDNN linear op on the CPU")
    before = selected()
    _chosen[0] = backend
    try:
        yield
    finally:
        _chosen[0] = before


def _float32_cpu(*ts: Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_cpu for t in ts)


def _route(x: Tensor, w: Tensor) -> tuple[str, ops.Library | None]:
    """Where x·Wᵀ or G·W goes ("native", "onednn" or "torch"), with the library for
    "native". Called for every product of a step: the cheap tests first."""
    backend = selected()
    if backend == "torch" or x.dim() != 2 or not _float32_cpu(x, w):
        return "torch", None
    if x.shape[0] * w.numel() >= MIN_WORK and x.is_contiguous() and _available():
        return "onednn", None
    lib = ops.loaded() if backend == "native" else None
    return ("native", lib) if lib is not None else ("torch", None)


def xwt(x: Tensor, w: Tensor, out: Tensor | None = None) -> Tensor:
    """x·Wᵀ, an (N, O) tensor (``out`` where given), for x (N, I) and a weight W (O, I)."""
    route, lib = _route(x, w)
    if lib is not None:
        return lib.matmul(x.contiguous(), w.contiguous(), b_t=True, out=out)
    if route == "onednn" and out is None:
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return torch.mm(x, w.t(), out=out)


def xwt_add(y: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """y + x·Wᵀ for y (N, O): a new tensor with oneDNN (its sum fused into the product),
    y itself, added to in place, otherwise. The caller keeps the returned tensor."""
    route, lib = _route(x, w)
    if lib is not None and y.dtype == torch.float32 and y.is_contiguous():
        return lib.matmul(x.contiguous(), w.contiguous(), b_t=True, out=y, accumulate=True)
    if route == "onednn" and y.dtype == torch.float32 and y.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise.binary(x, y, w, None, "add")
    return y.addmm_(x, w.t())


def xw(g: Tensor, w: Tensor, out: Tensor | None = None) -> Tensor:
    """G·W, an (N, I) tensor (``out`` where given), for G (N, O) and a weight W (O, I):
    the input's gradient of a linear layer."""
    route, lib = _route(g, w)
    if lib is not None:
        return lib.matmul(g.contiguous(), w.contiguous(), out=out)
    if route == "onednn" and out is None:
        return torch.ops.mkldnn._linear_pointwise(g, w.t(), None, "none", [], "")
    return torch.mm(g, w, out=out)


def all_native(rows: int, *weights: Tensor) -> ops.Library | None:
    """The library where every product of ``rows`` rows with each of ``weights`` (x·Wᵀ,
    G·W and Gᵀ·X) goes to tinylm's kernel, else None: then a step that makes them all
    can run as one native call (csrc/train_block.c), no Python between its products."""
    if selected() != "native" or not _float32_cpu(*weights) or \
            rows * max(w.numel() for w in weights) >= MIN_WORK:
        return None
    return ops.loaded()


def gtx(g: Tensor, x: Tensor) -> Tensor:
    """Gᵀ·X, a new (O, I) tensor, for G (N, O) and X (N, I): the weight's gradient of a
    linear layer (tinylm's kernel under "native", torch's mm otherwise)."""
    lib = ops.loaded() if selected() == "native" else None
    if lib is not None and g.dim() == 2 and _float32_cpu(g, x):
        return lib.matmul(g.contiguous(), x.contiguous(), a_t=True)
    return g.t() @ x
