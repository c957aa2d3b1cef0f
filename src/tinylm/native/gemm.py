"""The matrix products of the native training steps on the CPU, on the faster of torch's
two fp32 GEMM libraries.

torch's CPU ``mm`` calls MKL. MKL takes its generic code path on AMD CPUs, where oneDNN's
fp32 linear (``torch.ops.mkldnn._linear_pointwise``, the op inductor uses for linear
layers when it freezes weights for CPU inference) is faster for the large products a
block's forward and its input gradients compute: x·Wᵀ and G·W, rows of activations on
the left
(6×384 B=8 on an AMD EPYC, 2 threads: those products 1.1–1.5× faster, a training step
1.03–1.10×; ``python benchmarks/gemm.py`` measures both libraries side by side).
The weight gradients Gᵀ·X keep torch's ``mm``: their left operand is transposed, which
oneDNN first copies, and MKL is the faster there.

Both compute IEEE fp32 products (no reduced-precision modes); they differ only in the
order of the sums, so a block's outputs agree within float32 rounding
(tests/test_gemm.py holds each product to float64, and a training step with every
product on oneDNN to the reference model).

The choice is made once (:func:`selected`): ``"onednn"`` where torch was built with
oneDNN and has the op, ``"torch"`` otherwise, or as ``TINYLM_GEMM=torch`` (or ``onednn``)
says; :func:`using` switches it for a block of code (tests, benchmarks). Tensors that are
not float32 on the CPU always take torch's ``mm``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from tinylm.core.errors import ConfigError

BACKENDS = ("onednn", "torch")
#: Products of fewer multiply-adds (N·I·O) than this stay on torch's mm: with every product
#: on oneDNN a 4×128 B=12 training step was 1.09× slower in-process, although single
#: products of its sizes time faster in isolation; 6×384's (≥ 3·10⁸) gain.
MIN_WORK = 1 << 27
_chosen: list[str] = []  # the backend in use, decided on first call


def _available() -> bool:
    """Whether this torch has oneDNN's linear op on the CPU."""
    return torch.backends.mkldnn.is_available() and \
        hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _decide() -> str:
    asked = os.environ.get("TINYLM_GEMM", "").strip().lower()
    if asked and asked not in BACKENDS:
        raise ConfigError(f"TINYLM_GEMM={asked!r} is not a GEMM backend: set it to one of "
                          f"{', '.join(BACKENDS)}, or unset it")
    if asked == "torch" or not _available():
        return "torch"
    return "onednn"


def selected() -> str:
    """The backend the native steps' products use: "onednn" or "torch"."""
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


def _onednn(x: Tensor, w: Tensor) -> bool:
    """Whether x (rows on the left) and w take oneDNN's path."""
    return (x.dim() == 2 and x.shape[0] * w.numel() >= MIN_WORK  # small: no more checks
            and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.device.type == "cpu" and w.device.type == "cpu" and x.is_contiguous()
            and selected() == "onednn")


def xwt(x: Tensor, w: Tensor) -> Tensor:
    """x·Wᵀ, a new (N, O) tensor, for x (N, I) and a weight W (O, I)."""
    if _onednn(x, w):
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    return x @ w.t()


def xwt_add(y: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """y + x·Wᵀ for y (N, O): a new tensor with oneDNN (its sum fused into the product),
    y itself, added to in place, with torch. The caller keeps the returned tensor."""
    if _onednn(x, w) and y.dtype == torch.float32 and y.is_contiguous():
        return torch.ops.mkldnn._linear_pointwise.binary(x, y, w, None, "add")
    return y.addmm_(x, w.t())


def xw(g: Tensor, w: Tensor) -> Tensor:
    """G·W, a new (N, I) tensor, for G (N, O) and a weight W (O, I): the input's gradient
    of a linear layer."""
    if _onednn(g, w):
        return torch.ops.mkldnn._linear_pointwise(g, w.t(), None, "none", [], "")
    return g @ w
