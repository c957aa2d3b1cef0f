"""The native steps' matrix products on oneDNN (tinylm.native.gemm) equal torch's and the
reference model's.

The oracle for each product is float64 arithmetic; for a whole training step, the
reference model's loss and gradients (as tests/test_equivalence.py and
test_variant_block.py, at the same tolerances). The tiny test models' products are far
below ``gemm.MIN_WORK``, so these tests lower it to 0 to put every product on oneDNN, and
check with torch's profiler that oneDNN's op really ran.
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
from tinylm.native import gemm  # noqa: E402

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


@pytest.fixture
def every_product(monkeypatch):
    """Every float32 CPU product on oneDNN, whatever its size."""
    monkeypatch.setattr(gemm, "MIN_WORK", 0)
    with gemm.using("onednn"):
        yield


@pytest.mark.parametrize("shape", [(7, 33, 19), (64, 48, 192), (300, 128, 96)])
def test_each_product_equals_float64_on_both_backends(monkeypatch, shape) -> None:
    monkeypatch.setattr(gemm, "MIN_WORK", 0)
    N, I, O = shape
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(N, I, generator=g), torch.randn(O, I, generator=g)
    y, grad = torch.randn(N, O, generator=g), torch.randn(N, O, generator=g)
    want = {"xwt": x.double() @ w.double().t(), "xwt_add": y.double() + x.double() @ w.double().t(),
            "xw": grad.double() @ w.double()}
    for backend, ops_expected in (("onednn", 3), ("torch", 0)):
        with gemm.using(backend):
            got, calls = _onednn_calls(lambda: {
                "xwt": gemm.xwt(x, w), "xwt_add": gemm.xwt_add(y.clone(), x, w),
                "xw": gemm.xw(grad, w)})
        assert calls == ops_expected, backend
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
def test_training_step_on_onednn_equals_the_reference(every_product, arch) -> None:
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
    assert calls > 0
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    for (name, _), g, w in zip(reference.named_parameters(), grads, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=2e-5, msg=name)


def test_the_backend_comes_from_tinylm_gemm(monkeypatch) -> None:
    monkeypatch.setattr(gemm, "_chosen", [])
    monkeypatch.setenv("TINYLM_GEMM", "torch")
    assert gemm.selected() == "torch"
    monkeypatch.setattr(gemm, "_chosen", [])
    monkeypatch.delenv("TINYLM_GEMM")
    assert gemm.selected() == "onednn"
    monkeypatch.setattr(gemm, "_chosen", [])
    monkeypatch.setenv("TINYLM_GEMM", "cublas")
    with pytest.raises(ConfigError, match="TINYLM_GEMM='cublas' is not a GEMM backend"):
        native.plan(GPT(ModelConfig(vocab_size=11, context_length=8, n_layer=1, n_head=1,
                                    n_embd=16)), "cpu")
    with pytest.raises(ValueError, match="unknown GEMM backend"):
        with gemm.using("mkl"):
            pass
