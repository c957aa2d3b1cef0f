"""The native steps' matrix products (tinylm.native.gemm) on tinylm's own kernel
(csrc/gemm.c) and on oneDNN equal float64 arithmetic and the reference model.

The oracle for each product is float64 arithmetic; for a whole training step, the
reference model's loss and gradients (as tests/test_equivalence.py and
test_variant_block.py, at the same tolerances). The tiny test models' products are far
below ``gemm.MIN_WORK``, so the oneDNN tests lower it to 0 to put every product on
oneDNN, and check with torch's profiler that oneDNN's op really ran; the native tests
count the calls of the library's ``matmul``.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from tinylm import GPT, ModelConfig
from tinylm.core.errors import ConfigError

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native import gemm, ops  # noqa: E402

pytestmark = [pytest.mark.skipif(not gemm._available(),
                                 reason="this torch has no oneDNN linear op"),
              pytest.mark.skipif(os.environ.get("TINYLM_NATIVE") == "0",
                                 reason="TINYLM_NATIVE=0: no native step calls these")]

ONEDNN_OP = "mkldnn::_linear_pointwise"


def _onednn_calls(fn) -> tuple[object, int]:
    """(fn(), how many oneDNN linear ops it ran)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = fn()
    return out, sum(e.count for e in prof.key_averages() if e.key.startswith(ONEDNN_OP))


def _native_calls(monkeypatch) -> list[int]:
    """A one-element counter, from now on, of the native library's calls that run
    tinylm's kernel: its matmul, and a whole block's step (csrc/train_block.c)."""
    lib = ops.load()
    assert lib is not None, "the native library did not build"
    calls = [0]
    for name in ("matmul", "block_train_forward", "block_train_backward"):
        real = getattr(lib, name)

        def counted(*args, real=real, **kwargs):
            calls[0] += 1
            return real(*args, **kwargs)
        monkeypatch.setattr(lib, name, counted)
    return calls


@pytest.fixture(params=["native", "onednn"])
def every_product(request, monkeypatch):
    """Every float32 CPU product on one backend: tinylm's kernel (the products of the
    tiny models are all below MIN_WORK), or oneDNN, whatever their size. Yields a
    function that says whether that backend ran."""
    if request.param == "onednn":
        monkeypatch.setattr(gemm, "MIN_WORK", 0)
        counter = None
    else:
        counter = _native_calls(monkeypatch)
    with gemm.using(request.param):
        yield lambda calls: calls > 0 if counter is None else counter[0] > 0


@pytest.mark.parametrize("shape", [(7, 33, 19), (64, 48, 192), (300, 128, 96)])
def test_each_product_equals_float64_on_both_backends(monkeypatch, shape) -> None:
    monkeypatch.setattr(gemm, "MIN_WORK", 0)
    N, I, O = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(N, I, generator=g), torch.randn(O, I, generator=g)
    y, grad = torch.randn(N, O, generator=g), torch.randn(N, O, generator=g)
    want = {"xwt": x.double() @ w.double().t(), "xwt_add": y.double() + x.double() @ w.double().t(),
            "xw": grad.double() @ w.double()}
    want["gtx"] = grad.double().t() @ x.double()
    native_calls = _native_calls(monkeypatch)
    for backend, ops_expected, native_expected in (("onednn", 3, 0), ("torch", 0, 0),
                                                   ("native", 3, 1)):
        native_calls[0] = 0
        with gemm.using(backend):
            got, calls = _onednn_calls(lambda: {
                "xwt": gemm.xwt(x, w), "xwt_add": gemm.xwt_add(y.clone(), x, w),
                "xw": gemm.xw(grad, w), "gtx": gemm.gtx(grad, x)})
        # MIN_WORK = 0: x·Wᵀ and G·W on oneDNN under "native" too, Gᵀ·X on tinylm's kernel
        assert (calls, native_calls[0]) == (ops_expected, native_expected), backend
        for name, t in got.items():
            assert t.dtype == torch.float32
            torch.testing.assert_close(t.double(), want[name], rtol=1e-5, atol=1e-4,
                                       msg=f"{backend} {name}")


def test_small_products_and_other_dtypes_stay_on_torch() -> None:
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    with gemm.using("onednn"):
        _, calls = _onednn_calls(lambda: (gemm.xwt(x, w), gemm.xw(torch.randn(8, 4), w),
                                          gemm.xwt(x.double(), w.double())))
    assert calls == 0  # 8·4·16 multiply-adds, far below MIN_WORK; and float64
    big_x, big_w = torch.randn(1024, 512), torch.randn(512, 512)
    with gemm.using("onednn"):
        out, calls = _onednn_calls(lambda: gemm.xwt(big_x, big_w))
    assert calls == 1 and big_x.shape[0] * big_w.numel() >= gemm.MIN_WORK
    torch.testing.assert_close(out, big_x @ big_w.t(), rtol=1e-4, atol=1e-3)


def _step(model: GPT, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    return loss, list(torch.autograd.grad(loss, list(model.parameters())))


@pytest.mark.parametrize("arch", [{}, {"bias": False, "tie_embeddings": False},
                                  {"norm": "rmsnorm", "position": "rope", "mlp": "swiglu",
                                   "bias": False, "n_kv_head": 1}])
def test_training_step_on_each_backend_equals_the_reference(every_product, arch) -> None:
    torch.manual_seed(0)
    reference = GPT(ModelConfig(vocab_size=50, context_length=40, n_layer=2, n_head=2,
                                n_embd=64, dropout=0.0, **arch)).train()
    with torch.no_grad():  # off the init values: every gradient differs
        for p in reference.parameters():
            p += 0.05 * torch.randn_like(p)
    fast = copy.deepcopy(reference)
    plan = native.accelerate(fast, "cpu")
    assert plan.paths & {"block"}, plan.paths
    ids = torch.randint(0, 50, (3, 30), generator=torch.Generator().manual_seed(1))
    want_loss, want = _step(reference, ids)
    (loss, grads), calls = _onednn_calls(lambda: _step(fast, ids))
    assert every_product(calls)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for (name, _), g, w in zip(reference.named_parameters(), grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5, msg=name)


def test_the_backend_comes_from_tinylm_gemm(monkeypatch) -> None:
    monkeypatch.setattr(gemm, "_chosen", [])
    monkeypatch.setenv("TINYLM_GEMM", "torch")
    assert gemm.selected() == "torch"
    monkeypatch.setattr(gemm, "_chosen", [])
    monkeypatch.delenv("TINYLM_GEMM")
    assert ops.load() is not None
    assert gemm.selected() == "native"  # the default where the native library is loaded
    monkeypatch.setattr(gemm, "_chosen", [])
    with native.disabled():
        assert gemm.selected() == "onednn"  # the default without it
    monkeypatch.setattr(gemm, "_chosen", [])
    monkeypatch.setenv("TINYLM_GEMM", "onednn")
    assert gemm.selected() == "onednn"
    monkeypatch.setattr(gemm, "_chosen", [])
    monkeypatch.setenv("TINYLM_GEMM", "cublas")
    with pytest.raises(ConfigError, match="TINYLM_GEMM='cublas' is not a GEMM backend"):
        native.plan(GPT(ModelConfig(vocab_size=11, context_length=8, n_layer=1, n_head=1,
                                    n_embd=16)), "cpu")
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        with gemm.using("mkl"):
            pass


# --- tinylm's kernel itself (csrc/gemm.c through Library.matmul) ----------------------------


@pytest.mark.parametrize("M,N,K", [(1, 1, 1), (5, 15, 3), (6, 64, 128), (7, 65, 300),
                                   (97, 130, 513), (300, 16, 0)])
@pytest.mark.parametrize("form", ["x·Wᵀ", "G·W", "Gᵀ·X"])
def test_native_matmul_equals_float64(M, N, K, form) -> None:
    """Each form at sizes off every blocking edge (rows past a multiple of the
    micro-kernel's 6, columns past its panel width, k past its chunk of 256, k = 0),
    written fresh and added to an existing tensor."""
    lib = ops.load()
    g = torch.Generator().manual_seed(M * N + K)
    a = torch.randn((K, M) if form == "Gᵀ·X" else (M, K), generator=g)
    b = torch.randn((N, K) if form == "x·Wᵀ" else (K, N), generator=g)
    want = (a.double().t() if form == "Gᵀ·X" else a.double()) @ \
        (b.double().t() if form == "x·Wᵀ" else b.double())
    flags = dict(a_t=form == "Gᵀ·X", b_t=form == "x·Wᵀ")
    got = lib.matmul(a, b, **flags)
    base = torch.randn(M, N, generator=g)
    added = lib.matmul(a, b, out=base.clone(), accumulate=True, **flags)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(added.double(), want + base.double(), rtol=1e-5, atol=1e-4)


def test_native_matmul_does_not_depend_on_the_thread_count() -> None:
    """Each element is summed by one thread, over k in the same order: bit-identical
    results at 1, 2 and 3 threads."""
    lib = ops.load()
    g = torch.Generator().manual_seed(3)
    a, b, w = torch.randn(100, 70, generator=g), torch.randn(100, 40, generator=g), \
        torch.randn(40, 70, generator=g)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append((lib.matmul(a, w, b_t=True), lib.matmul(a, b, a_t=True)))
    finally:
        torch.set_num_threads(before)
    for other in results[1:]:
        assert all(torch.equal(x, y) for x, y in zip(results[0], other, strict=True))


def test_native_matmul_refuses_what_it_cannot_take() -> None:
    lib = ops.load()
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    with pytest.raises(ops.OpError, match="inner sizes differ"):
        lib.matmul(a, torch.randn(4, 5))
    with pytest.raises(ops.OpError, match="not both"):
        lib.matmul(a, b, a_t=True, b_t=True)
    with pytest.raises(ops.OpError, match="accumulate needs an out"):
        lib.matmul(a, b, accumulate=True)
    with pytest.raises(ops.OpError, match="must have shape"):
        lib.matmul(a, b, out=torch.empty(4, 4))
    with pytest.raises(ops.OpError, match="contiguous"):
        lib.matmul(a.t(), torch.randn(4, 5))
    with pytest.raises(ops.OpError, match="float32"):
        lib.matmul(a.double(), b)


def test_the_work_size_python_computes_is_the_kernels() -> None:
    """Library.matmul sizes csrc/gemm.c's work buffer itself (a ctypes call less per
    product): the same numbers as tl_gemm_work."""
    lib = ops.load()
    nr = lib.gemm_width
    for N, K in ((1, 1), (nr, 7), (nr + 1, 300), (3 * nr, 128), (65, 128)):
        for wt in (0, 1):
            want = lib.raw.tl_gemm_work(N, K, wt)
            got = -(-N // nr) * K * nr if wt else (K * nr if N % nr else 0)
            assert got == want, (N, K, wt)
