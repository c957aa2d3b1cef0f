"""Native CPU kernels: the few-row matrix products of a decoding step, and the pieces of
a training step that torch runs slowly on a CPU at GPT sizes.

Decoding: a cached decoding step multiplies B (1..16) rows by every weight matrix once, so its
speed is the speed at which the weights stream from memory. torch's CPU kernels for
such shapes (MKL GEMV / small-M GEMM) read the weights well below the machine's
bandwidth; ``kernels.c`` beside this file reads them once, in order, from a packed
copy (panels of 32 output features) with software prefetch.

The C source is compiled on first use with the system C compiler
(``cc -O3 -march=native -fopenmp``) into a per-user cache folder, keyed by the
source, the compiler and the CPU, then loaded with ctypes. Where that cannot work (no
compiler, not x86/ARM Linux or macOS with OpenMP, a read-only cache, a failing
self-check) :func:`available` is False and callers keep torch's own kernels. Set
``TINYLM_NATIVE=0`` to turn the kernel off.

Only float32, CPU, contiguous weights are packed; :class:`PackedLinear` falls back to
``F.linear`` for inputs with more than :data:`MAX_ROWS` rows (a prompt pass), which
BLAS GEMMs handle well.

Training: the FFN's bias add + GELU and its backward (:func:`bias_gelu_`,
:func:`gelu_backward`), causal attention straight from the fused QKV projection with a
recomputing backward (:func:`causal_attention`, for contexts up to
:data:`ATTENTION_MAX_CONTEXT`), and LayerNorm forward/backward (:func:`layer_norm`),
each checked against torch before first use. tinylm.model strings them into one
autograd step per block.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
MAX_ROWS = 16  # inputs with more rows go to F.linear
_COMPILE_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "tinylm" / "kernels"


def _cpu_signature() -> str:
    """What -march=native depends on: the machine and its CPU feature flags."""
    sig = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    sig += line
    except OSError:
        sig += platform.processor()
    return sig


def _compile(compiler: str, out: Path) -> None:
    """Compile SOURCE into the shared library ``out`` (atomic: temp file, then rename)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *_COMPILE_FLAGS, str(SOURCE), "-o", tmp, "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    c_long, c_int, c_void_p = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
    lib.tl_packed_size.argtypes = [c_long, c_long]
    lib.tl_packed_size.restype = c_long
    lib.tl_pack.argtypes = [c_void_p, c_void_p, c_long, c_long, c_int]
    lib.tl_pack.restype = None
    lib.tl_linear.argtypes = [c_void_p, c_long, c_void_p, c_void_p, c_void_p,
                              c_long, c_long, c_long, c_int, c_int, c_void_p]
    lib.tl_linear.restype = None
    lib.tl_argmax.argtypes = [c_void_p, c_long, c_long, c_long, c_void_p, c_int]
    lib.tl_argmax.restype = None
    lib.tl_attend_one.argtypes = [c_void_p, c_long, c_long] * 3 + [
        c_void_p, c_void_p, c_long, c_long, c_long, c_long, c_long, c_long, ctypes.c_float,
        c_void_p, c_void_p, c_int]
    lib.tl_attend_one.restype = None
    lib.tl_embed.argtypes = [c_void_p, c_void_p, c_void_p, c_long, c_void_p, c_long, c_long,
                             c_long]
    lib.tl_embed.restype = ctypes.c_int
    lib.tl_gelu_backward.argtypes = [c_void_p] * 4 + [c_long, c_long, c_int]
    lib.tl_gelu_backward.restype = None
    lib.tl_bias_gelu.argtypes = [c_void_p, c_void_p, c_void_p, c_long, c_long, c_int]
    lib.tl_bias_gelu.restype = None
    lib.tl_attn_fwd.argtypes = [c_void_p] * 4 + [c_long] * 4 + [ctypes.c_float, c_int]
    lib.tl_attn_fwd.restype = None
    lib.tl_attn_bwd.argtypes = [c_void_p] * 6 + [c_long] * 4 + [ctypes.c_float, c_int]
    lib.tl_attn_bwd.restype = None
    lib.tl_ln_fwd.argtypes = [c_void_p] * 6 + [c_long, c_long, ctypes.c_float, c_int]
    lib.tl_ln_fwd.restype = None
    lib.tl_ln_bwd.argtypes = [c_void_p] * 8 + [c_long, c_long, c_int]
    lib.tl_ln_bwd.restype = None
    return lib


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") \
        or shutil.which("clang")
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    key = hashlib.sha256(SOURCE.read_bytes() + compiler.encode() + _cpu_signature().encode()
                         + " ".join(_COMPILE_FLAGS).encode()).hexdigest()[:16]
    name = f"tinylm_kernels_{key}.so"
    error: OSError | None = None
    for folder in (_cache_dir(), Path(tempfile.gettempdir()) / "tinylm-kernels"):
        path = folder / name
        try:
            if not path.exists():
                _compile(compiler, path)
            return _bind(ctypes.CDLL(str(path)))
        except PermissionError as e:  # a read-only cache folder: try the next one
            error = e
    assert error is not None
    raise error


def _self_check(lib: ctypes.CDLL) -> None:
    """Every kernel against its torch equivalent on small odd shapes (vector bodies and
    scalar tails): a miscompiled library is never used."""
    g = torch.Generator().manual_seed(0)
    for O, I in ((37, 19), (64, 33)):
        W, b = torch.randn(O, I, generator=g), torch.randn(O, generator=g)
        packed = _pack(lib, W)
        for M in (1, 3, 8, 11):
            x = torch.randn(M, I, generator=g)
            for bias in (None, b):
                got = _linear(lib, x, packed, bias, O)
                if not torch.allclose(got, F.linear(x, W, bias), rtol=1e-4, atol=1e-4):
                    raise RuntimeError(f"linear self-check failed at O={O} I={I} M={M}")
    for B, H, D, T in ((2, 3, 16, 5), (1, 2, 20, 1)):
        q, k, v = (torch.randn(B, 1, 3, H, D, generator=g).permute(2, 0, 3, 1, 4).unbind(0))
        kc, vc = torch.randn(2, B, H, T + 2, D, generator=g).unbind(0)
        got = _attend_one(lib, q, k, v, kc, vc, T - 1, torch.empty(B * H * T))
        want = F.scaled_dot_product_attention(q, kc[:, :, :T], vc[:, :, :T])
        if not (torch.equal(kc[:, :, T - 1:T], k) and torch.allclose(got, want, atol=1e-5)):
            raise RuntimeError(f"attention self-check failed at B={B} H={H} D={D} T={T}")
    for V in (1, 7, 16, 100):
        x = torch.randn(3, V, generator=g)
        x[1] = x[1].round()  # ties: the first index wins
        x[2, V // 2] = float("nan")  # NaN counts as the largest, as in torch.argmax
        if not torch.equal(_argmax(lib, x), x.argmax(-1)):
            raise RuntimeError(f"argmax self-check failed at V={V}")
    h, b = torch.randn(5, 37, generator=g) * 4, torch.randn(37, generator=g)
    want_g = F.gelu(h + b, approximate="tanh")
    grad = torch.randn(5, 37, generator=g)
    want_grad = torch.ops.aten.gelu_backward(grad, h + b, approximate="tanh")
    lib_g = torch.empty_like(h)
    lib.tl_bias_gelu(h.data_ptr(), b.data_ptr(), lib_g.data_ptr(), 5, 37, 2)  # h += b
    recomputed, colsum = torch.empty_like(h), torch.empty(37)
    lib.tl_gelu_backward(h.data_ptr(), grad.data_ptr(), recomputed.data_ptr(),
                         colsum.data_ptr(), 5, 37, 2)
    if not (torch.allclose(lib_g, want_g, atol=1e-5)
            and torch.allclose(recomputed, lib_g, atol=1e-6)
            and torch.allclose(grad, want_grad, atol=1e-4)
            and torch.allclose(colsum, want_grad.sum(0), atol=1e-4)):
        raise RuntimeError("GELU self-check failed")
    B, C, H, D = 2, 19, 2, 16  # causal attention, forward and backward, against SDPA
    grad = torch.randn(B, C, H, D, generator=g)
    bias = torch.randn(3 * H * D, generator=g)
    with torch.inference_mode(False), torch.enable_grad():  # load() may run under either
        qkv = torch.randn(B, C, 3 * H * D, generator=g, requires_grad=True)
        q, k, v = (qkv + bias).view(B, C, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        (want_grad,) = torch.autograd.grad(want, qkv, grad)
    qkv = qkv.detach().clone()
    out, lse = torch.empty(B, C, H * D), torch.empty(B, H, C)
    got_grad, got_bias_grad = torch.empty(B, C, 3 * H * D), torch.empty(3 * H * D)
    lib.tl_attn_fwd(qkv.data_ptr(), bias.data_ptr(), out.data_ptr(), lse.data_ptr(),
                    B, C, H, D, D**-0.5, 2)  # qkv += bias, in place
    lib.tl_attn_bwd(qkv.data_ptr(), out.data_ptr(), grad.data_ptr(), lse.data_ptr(),
                    got_grad.data_ptr(), got_bias_grad.data_ptr(), B, C, H, D, D**-0.5, 2)
    if not (torch.allclose(out, want.reshape(B, C, H * D), atol=1e-5)
            and torch.allclose(got_grad, want_grad, atol=1e-4)
            and torch.allclose(got_bias_grad, want_grad.sum((0, 1)), atol=1e-4)):
        raise RuntimeError("causal attention self-check failed")
    x, w = torch.randn(5, 37, generator=g) * 3 + 1, torch.randn(37, generator=g)
    grad = torch.randn(5, 37, generator=g)
    with torch.inference_mode(False), torch.enable_grad():
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        want = F.layer_norm(xr, (37,), wr, br, 1e-5)
        want_grads = torch.autograd.grad(want, [xr, wr, br], grad)
    y, mean, rstd = torch.empty_like(x), torch.empty(5), torch.empty(5)
    lib.tl_ln_fwd(x.data_ptr(), w.data_ptr(), b.data_ptr(), y.data_ptr(), mean.data_ptr(),
                  rstd.data_ptr(), 5, 37, 1e-5, 2)
    grads = torch.empty_like(x), torch.empty(37), torch.empty(37)
    lib.tl_ln_bwd(x.data_ptr(), w.data_ptr(), mean.data_ptr(), rstd.data_ptr(),
                  grad.data_ptr(), *(t.data_ptr() for t in grads), 5, 37, 2)
    if not (torch.allclose(y, want, atol=1e-5) and all(
            torch.allclose(got, ref, atol=1e-4)
            for got, ref in zip(grads, want_grads, strict=True))):
        raise RuntimeError("LayerNorm self-check failed")


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, built on first call; None where it cannot be used."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("TINYLM_NATIVE", "1") == "0":
            log.debug("native kernels off (TINYLM_NATIVE=0)")
            return None
        if sys.platform not in ("linux", "darwin") or sys.byteorder != "little":
            return None
        try:
            lib = _build()
            _self_check(lib)
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", b"") or b""
            log.info("native kernels unavailable (%s%s); using torch's kernels",
                     e, ": " + detail.decode(errors="replace")[:200] if detail else "")
            return None
        _lib = lib
    return _lib


def available() -> bool:
    """True when the native kernel compiled, loaded and passed its self-check."""
    return load() is not None


def _pack(lib: ctypes.CDLL, weight: Tensor) -> Tensor:
    O, I = weight.shape
    w = weight.detach().contiguous()
    out = torch.empty(lib.tl_packed_size(O, I), dtype=torch.float32)
    lib.tl_pack(w.data_ptr(), out.data_ptr(), O, I, torch.get_num_threads())
    return out


def _linear(lib: ctypes.CDLL, x: Tensor, packed: Tensor, bias: Tensor | None,
            out_features: int) -> Tensor:
    """x (M, I) contiguous float32 -> (M, O)."""
    M, I = x.shape
    y = torch.empty(M, out_features, dtype=torch.float32)
    lib.tl_linear(x.data_ptr(), I, packed.data_ptr(),
                  bias.data_ptr() if bias is not None else None, y.data_ptr(),
                  M, I, out_features, torch.get_num_threads(), 0, None)
    return y


def _argmax(lib: ctypes.CDLL, x: Tensor) -> Tensor:
    """x (B, V) float32 with unit stride along V -> (B,) int64."""
    B, V = x.shape
    out = torch.empty(B, dtype=torch.int64)
    lib.tl_argmax(x.data_ptr(), B, V, x.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


def _attend_one(lib: ctypes.CDLL, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor,
                v_cache: Tensor, pos: int, scratch: Tensor) -> Tensor:
    B, H, _, D = q.shape
    out = torch.empty(B, 1, H, D)
    lib.tl_attend_one(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0),
                      k.stride(1), v.data_ptr(), v.stride(0), v.stride(1), k_cache.data_ptr(),
                      v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), B, H, D, pos,
                      1.0 / math.sqrt(D), out.data_ptr(), scratch.data_ptr(),
                      torch.get_num_threads())
    return out.transpose(1, 2)  # (B, 1, H, D) -> (B, H, 1, D)


def attend_one(q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, pos: int,
               scratch: Tensor) -> Tensor:
    """One decoding step of causal attention: write k, v (B, H, 1, D) at position ``pos``
    of one layer's cache (B, H, max_len, D), then attend q (B, H, 1, D) over positions
    0..pos. Equals storing k, v and ``F.scaled_dot_product_attention(q, K, V)``; reads
    each cached key and value once. ``scratch`` holds at least B·H·(pos + 1) floats.
    Float32 CPU tensors whose last dimension is contiguous; the caller checks."""
    lib = load()
    if lib is None:
        raise RuntimeError("native kernels are not available")
    return _attend_one(lib, q, k, v, k_cache, v_cache, pos, scratch)


def argmax(logits: Tensor) -> Tensor:
    """``logits.argmax(-1)`` for (B, V) logits: the native kernel on float32 CPU rows
    (torch's CPU argmax takes ~10x longer on a GPT-2-sized vocabulary), torch otherwise."""
    lib = load()
    if (lib is None or logits.dim() != 2 or logits.dtype != torch.float32
            or logits.device.type != "cpu" or logits.stride(1) != 1 or logits.shape[1] == 0):
        return logits.argmax(-1)
    return _argmax(lib, logits)


def _native_elementwise(x: Tensor) -> ctypes.CDLL | None:
    if x.dtype != torch.float32 or x.device.type != "cpu" or not x.is_contiguous():
        return None
    return load()


def bias_gelu_(a: Tensor, bias: Tensor | None) -> Tensor:
    """``a += bias`` in place (a (..., N), bias (N,) or None), then return GELU(a) (tanh
    approximation) as a new tensor; one native pass on contiguous float32 CPU tensors."""
    lib = _native_elementwise(a)
    if lib is None or (bias is not None and not bias.is_contiguous()):
        if bias is not None:
            a.add_(bias)
        return F.gelu(a, approximate="tanh")
    g = torch.empty_like(a)
    N = a.shape[-1]
    lib.tl_bias_gelu(a.data_ptr(), bias.data_ptr() if bias is not None else None,
                     g.data_ptr(), a.numel() // N, N, torch.get_num_threads())
    return g


def gelu_backward(grad: Tensor, x: Tensor, *, sum_rows: bool = False
                  ) -> tuple[Tensor, Tensor, Tensor | None]:
    """(dL/dx, GELU(x), Σ_rows dL/dx or None) from dL/dGELU(x) and x (..., N), in one pass:
    the backward of the tanh GELU with its forward recomputed and, with ``sum_rows``,
    the gradient of a bias added before it. ``grad`` may be overwritten (it is returned
    as dL/dx)."""
    lib = _native_elementwise(x)
    if lib is None or not grad.is_contiguous() or grad.shape != x.shape \
            or grad.dtype != torch.float32:
        grad_x = torch.ops.aten.gelu_backward(grad, x, approximate="tanh")
        colsum = grad_x.reshape(-1, x.shape[-1]).sum(0) if sum_rows else None
        return grad_x, F.gelu(x, approximate="tanh"), colsum
    N = x.shape[-1]
    y = torch.empty_like(x)
    colsum = torch.empty(N) if sum_rows else None
    lib.tl_gelu_backward(x.data_ptr(), grad.data_ptr(), y.data_ptr(),
                         colsum.data_ptr() if colsum is not None else None,
                         x.numel() // N if N else 0, N, torch.get_num_threads())
    return grad, y, colsum


def layer_norm(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
               ) -> tuple[Tensor, Tensor, Tensor]:
    """``F.layer_norm`` over the last dimension of a contiguous float32 CPU ``x`` (..., E),
    also returning each row's mean and 1/std (for :func:`layer_norm_backward`)."""
    lib = load()
    E = x.shape[-1]
    M = x.numel() // E
    y, mean, rstd = torch.empty_like(x), torch.empty(M), torch.empty(M)
    lib.tl_ln_fwd(x.data_ptr(), weight.data_ptr() if weight is not None else None,
                  bias.data_ptr() if bias is not None else None, y.data_ptr(),
                  mean.data_ptr(), rstd.data_ptr(), M, E, eps, torch.get_num_threads())
    return y, mean, rstd


def layer_norm_backward(grad_y: Tensor, x: Tensor, weight: Tensor | None, mean: Tensor,
                        rstd: Tensor, need_weight: bool, need_bias: bool
                        ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """(dL/dx, dL/dweight or None, dL/dbias or None) of :func:`layer_norm`."""
    lib = load()
    E = x.shape[-1]
    M = x.numel() // E
    grad_y = grad_y.contiguous()
    dx = torch.empty_like(x)
    dw = torch.empty(E) if need_weight else None
    db = torch.empty(E) if need_bias else None
    lib.tl_ln_bwd(x.data_ptr(), weight.data_ptr() if weight is not None else None,
                  mean.data_ptr(), rstd.data_ptr(), grad_y.data_ptr(), dx.data_ptr(),
                  dw.data_ptr() if dw is not None else None,
                  db.data_ptr() if db is not None else None, M, E, torch.get_num_threads())
    return dx, dw, db


# Longest context the native causal attention takes: it holds a head's (C, C) weights
# per thread. Past this torch's SDPA (flash, O(C) memory) is used.
ATTENTION_MAX_CONTEXT = 256


def causal_attention_fits(context: int, n_head: int, head_dim: int, dtype: torch.dtype,
                          device: torch.device) -> bool:
    """Whether the native causal attention takes these shapes: float32 on CPU, head size a
    multiple of 16, 1 <= context <= ATTENTION_MAX_CONTEXT, and the kernel loaded."""
    return (dtype == torch.float32 and device.type == "cpu" and head_dim % 16 == 0
            and 0 < context <= ATTENTION_MAX_CONTEXT and n_head > 0 and load() is not None)


def causal_attention_supported(qkv: Tensor, n_head: int) -> bool:
    """Whether :func:`causal_attention` takes ``qkv`` (B, C, 3·H·D): contiguous, and
    :func:`causal_attention_fits` its shapes."""
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * n_head) or not qkv.is_contiguous():
        return False
    return causal_attention_fits(qkv.shape[1], n_head, qkv.shape[-1] // (3 * n_head),
                                 qkv.dtype, qkv.device)


def _attention_shape(qkv: Tensor, n_head: int) -> tuple[int, int, int, int, float]:
    B, C, three_hd = qkv.shape
    D = three_hd // (3 * n_head)
    return B, C, n_head, D, 1.0 / math.sqrt(D)


def causal_attention(qkv: Tensor, n_head: int, bias: Tensor | None = None
                     ) -> tuple[Tensor, Tensor]:
    """Causal softmax attention of every head, straight from the fused projection
    ``qkv`` (B, C, 3·H·D) laid out as (B, C, 3, H, D): returns the heads' outputs
    concatenated, (B, C, H·D), and each query's log-sum-exp (B, H, C) for
    :func:`causal_attention_backward`. Equals ``F.scaled_dot_product_attention(q, k, v,
    is_causal=True)`` on the split heads. ``bias`` (3·H·D,), if given, is first added
    to ``qkv`` in place (the projection's bias, fused into this pass). Only where
    :func:`causal_attention_supported`."""
    lib = load()
    B, C, H, D, scale = _attention_shape(qkv, n_head)
    out = torch.empty(B, C, H * D)
    lse = torch.empty(B, H, C)
    if bias is not None:
        bias = bias.detach().contiguous()
    lib.tl_attn_fwd(qkv.data_ptr(), bias.data_ptr() if bias is not None else None,
                    out.data_ptr(), lse.data_ptr(), B, C, H, D, scale, torch.get_num_threads())
    return out, lse


def causal_attention_backward(grad_out: Tensor, qkv: Tensor, out: Tensor, lse: Tensor,
                              n_head: int, *, bias_grad: bool = False
                              ) -> tuple[Tensor, Tensor | None]:
    """The gradient with respect to ``qkv`` (B, C, 3·H·D) of :func:`causal_attention`,
    given the gradient of its output (B, C, H·D); the attention weights are recomputed
    from ``lse``. Each of dQ, dK, dV is written once into the one returned buffer. With
    ``bias_grad``, also that gradient summed over the B·C rows (the bias's gradient)."""
    lib = load()
    B, C, H, D, scale = _attention_shape(qkv, n_head)
    grad_out = grad_out.contiguous()
    grad_qkv = torch.empty_like(qkv)
    grad_bias = torch.empty(qkv.shape[-1]) if bias_grad else None
    lib.tl_attn_bwd(qkv.data_ptr(), out.data_ptr(), grad_out.data_ptr(), lse.data_ptr(),
                    grad_qkv.data_ptr(), grad_bias.data_ptr() if bias_grad else None,
                    B, C, H, D, scale, torch.get_num_threads())
    return grad_qkv, grad_bias


# Packed copies by weight, so repeated generate() calls on one model pack once. The
# entry is dropped when the weight is freed, and rebuilt when the weight was changed
# in place (its version counter moved) or replaced.
_packed: dict[int, tuple[weakref.ref, int, int, Tensor]] = {}


def packed_weight(weight: Tensor) -> Tensor:
    """The panel-packed copy of a (O, I) float32 CPU weight, cached while it is unchanged."""
    lib = load()
    if lib is None:
        raise RuntimeError("native kernels are not available")
    key = id(weight)
    entry = _packed.get(key)
    if entry is not None:
        ref, version, ptr, packed = entry
        if ref() is weight and version == weight._version and ptr == weight.data_ptr():
            return packed
    packed = _pack(lib, weight)
    _packed[key] = (weakref.ref(weight, lambda _r, k=key: _packed.pop(k, None)),
                    weight._version, weight.data_ptr(), packed)
    return packed


def supports(weight: Tensor) -> bool:
    """Whether :class:`PackedLinear` can serve this weight (float32, CPU, 2-D)."""
    return (weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and available())


class PackedLinear:
    """``F.linear(x, weight, bias)`` through the native kernel for inputs of at most
    :data:`MAX_ROWS` rows (any leading shape), and through torch otherwise.

    Holds a packed copy of ``weight`` taken at construction: build it again after the
    weight changes. Inference only (no autograd).
    """

    def __init__(self, weight: Tensor, bias: Tensor | None) -> None:
        self.weight, self.bias = weight, bias
        self.out_features, self.in_features = weight.shape
        self.packed = packed_weight(weight)
        self.lib = load()
        self._bias = bias.detach().contiguous() if bias is not None else None

    def __call__(self, x: Tensor) -> Tensor:
        rows = x.numel() // self.in_features
        if rows > MAX_ROWS or x.dtype != torch.float32 or x.requires_grad:
            return F.linear(x, self.weight, self.bias)
        y = _linear(self.lib, x.reshape(rows, self.in_features).contiguous(), self.packed,
                    self._bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)  # (…, I) -> (…, O)
