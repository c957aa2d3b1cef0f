"""The native CPU kernels against torch's own ops as oracles."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tinylm import kernels

pytestmark = pytest.mark.skipif(os.environ.get("TINYLM_NATIVE") == "0",
                                reason="native kernels turned off by TINYLM_NATIVE=0")


def test_the_kernel_builds_and_loads_here() -> None:
    # This machine has a C compiler: the fast path must be live, not silently off.
    assert kernels.available()
    assert kernels.SOURCE.name == "kernels.c" and kernels.SOURCE.exists()


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (33, 17), (96, 64),
                                                           (130, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(rows: int, out_features: int, in_features: int,
                                       bias: bool) -> None:
    lin = torch.nn.Linear(in_features, out_features, bias=bias)
    packed = kernels.PackedLinear(lin.weight, lin.bias)
    x = torch.randn(rows, 1, in_features)  # (B, C=1, I), as in a decoding step
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x), rtol=1e-5, atol=1e-5)


def test_packed_linear_hands_long_inputs_to_torch() -> None:
    lin = torch.nn.Linear(8, 5)
    packed = kernels.PackedLinear(lin.weight, lin.bias)
    x = torch.randn(2, kernels.MAX_ROWS, 8)  # 32 rows: a prompt pass
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), lin(x))


def test_fused_epilogues_gelu_and_residual() -> None:
    lib = kernels.load()
    W, b = torch.randn(40, 24), torch.randn(40)
    x, res = torch.randn(3, 24), torch.randn(3, 40)
    packed = kernels.packed_weight(W)
    y = torch.empty(3, 40)
    lib.tl_linear(x.data_ptr(), 24, packed.data_ptr(), b.data_ptr(), y.data_ptr(), 3, 24, 40,
                  2, 1, None)
    torch.testing.assert_close(y, F.gelu(F.linear(x, W, b), approximate="tanh"),
                               rtol=1e-5, atol=1e-5)
    want = res + F.linear(x, W, b)
    lib.tl_linear(x.data_ptr(), 24, packed.data_ptr(), b.data_ptr(), res.data_ptr(), 3, 24, 40,
                  2, 0, res.data_ptr())  # in place: res = res + x·Wᵀ + b
    torch.testing.assert_close(res, want, rtol=1e-5, atol=1e-5)


def test_packed_copy_follows_in_place_weight_changes() -> None:
    W = torch.randn(20, 10)
    first = kernels.packed_weight(W)
    assert kernels.packed_weight(W) is first  # cached while unchanged
    with torch.no_grad():
        W.mul_(2)  # e.g. an optimizer step
    x = torch.randn(1, 10)
    torch.testing.assert_close(kernels.PackedLinear(W, None)(x), F.linear(x, W))


@pytest.mark.parametrize("V", [1, 5, 16, 17, 50257])
@pytest.mark.parametrize("B", [1, 3])
def test_argmax_equals_torch_with_ties_and_nan(V: int, B: int) -> None:
    logits = torch.randn(B, V)
    assert torch.equal(kernels.argmax(logits), logits.argmax(-1))
    tied = logits.clone()
    tied[:, -1] = tied[:, 0] = tied.max() + 1  # first and last share the maximum
    assert torch.equal(kernels.argmax(tied), torch.zeros(B, dtype=torch.long))
    if V > 2:
        logits[0, V // 2] = float("nan")  # torch.argmax treats NaN as the largest
        assert torch.equal(kernels.argmax(logits), logits.argmax(-1))
    strided = torch.randn(B, 2 * V)[:, :V]  # rows of a wider tensor
    assert torch.equal(kernels.argmax(strided), strided.argmax(-1))


@pytest.mark.parametrize(("B", "H", "D", "pos"), [(1, 1, 16, 0), (2, 3, 64, 9), (3, 2, 20, 30)])
def test_attend_one_equals_sdpa_over_the_cache(B: int, H: int, D: int, pos: int) -> None:
    qkv = torch.randn(B, 1, 3, H, D).permute(2, 0, 3, 1, 4)  # views, as MultiHeadAttention
    q, k, v = qkv.unbind(0)  # 3 × (B, H, 1, D), not contiguous
    k_cache, v_cache = torch.randn(B, H, 32, D), torch.randn(B, H, 32, D)
    out = kernels.attend_one(q, k, v, k_cache, v_cache, pos, torch.empty(B * H * 32))
    assert torch.equal(k_cache[:, :, pos:pos + 1], k) and torch.equal(v_cache[:, :, pos:pos + 1], v)
    want = F.scaled_dot_product_attention(q, k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_equals_f_layer_norm(affine: bool) -> None:
    x = torch.randn(4, 48) * 3 + 1
    w, b = (torch.randn(48), torch.randn(48)) if affine else (None, None)
    y, _, _ = kernels.layer_norm(x, w, b, 1e-5)  # also the decoding step's LayerNorm
    torch.testing.assert_close(y, F.layer_norm(x, (48,), w, b, 1e-5), rtol=1e-5, atol=1e-5)


def test_embed_rejects_out_of_range_ids() -> None:
    lib = kernels.load()
    tok, pos = torch.randn(10, 4), torch.randn(6, 4)
    x = torch.zeros(2, 4)
    ids = torch.tensor([3, 9])
    assert lib.tl_embed(ids.data_ptr(), tok.data_ptr(), pos.data_ptr(), 2, x.data_ptr(),
                        2, 4, 10) == 0
    torch.testing.assert_close(x, tok[ids] + pos[2])
    bad = torch.tensor([3, 10])
    assert lib.tl_embed(bad.data_ptr(), tok.data_ptr(), pos.data_ptr(), 2, x.data_ptr(),
                        2, 4, 10) == 1


def test_without_a_compiler_everything_falls_back(tmp_path) -> None:
    # A fresh process with no compiler and an empty cache: available() is False and
    # generation still works through torch's kernels.
    code = (
        "import torch, tinylm\n"
        "from tinylm import kernels, GPT, ModelConfig, generate\n"
        "from tinylm.decoding import Decoder\n"
        "m = GPT(ModelConfig(vocab_size=11, context_length=8, n_layer=1, n_head=1, "
        "n_embd=8)).eval()\n"
        "assert not kernels.available()\n"
        "with torch.inference_mode(), Decoder(m, 1) as d: assert d.path == 'torch'\n"
        "print(generate(m, [1, 2], 3, temperature=0).shape)\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path),
               TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch.Size([1, 5])"


def test_gelu_and_its_fused_backward_equal_torch() -> None:
    x = torch.randn(3, 37, 20) * 4  # 2220 floats: vector body and scalar tail
    x.view(-1)[:6] = torch.tensor([0.0, 1e-8, -60.0, 60.0, 100.0, -100.0])
    torch.testing.assert_close(kernels.bias_gelu_(x.clone(), None),
                               F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(x)
    want = torch.ops.aten.gelu_backward(grad, x, approximate="tanh")
    grad_x, y, none = kernels.gelu_backward(grad.clone(), x)
    assert none is None
    torch.testing.assert_close(grad_x, want, rtol=1e-5, atol=1e-5)
    _, _, colsum = kernels.gelu_backward(grad.clone(), x, sum_rows=True)  # a bias's gradient
    torch.testing.assert_close(colsum, want.reshape(-1, 20).sum(0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_ffn_function_gradients_equal_plain_autograd(bias: bool) -> None:
    from tinylm.model import _FeedForwardFn

    x = torch.randn(2, 5, 12, requires_grad=True)
    w_up, w_down = torch.randn(48, 12, requires_grad=True), torch.randn(12, 48, requires_grad=True)
    b_up = torch.randn(48, requires_grad=True) if bias else None
    b_down = torch.randn(12, requires_grad=True) if bias else None
    inputs = [t for t in (x, w_up, b_up, w_down, b_down) if t is not None]
    gy = torch.randn(2, 5, 12)
    y = _FeedForwardFn.apply(x, w_up, b_up, w_down, b_down)
    ref = F.linear(F.gelu(F.linear(x, w_up, b_up), approximate="tanh"), w_down, b_down)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(y, inputs, gy)
    want = torch.autograd.grad(ref, inputs, gy)
    for got, w in zip(grads, want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)


def test_bias_gelu_adds_in_place_and_returns_gelu() -> None:
    a, b = torch.randn(7, 37), torch.randn(37)
    want_h = a + b
    g = kernels.bias_gelu_(a, b)
    torch.testing.assert_close(a, want_h)
    torch.testing.assert_close(g, F.gelu(want_h, approximate="tanh"), rtol=1e-5, atol=1e-6)


def _sdpa_from_qkv(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """The oracle: split the fused projection into heads and run torch's causal SDPA."""
    B, C, three_hd = qkv.shape
    D = three_hd // (3 * n_head)
    q, k, v = qkv.view(B, C, 3, n_head, D).permute(2, 0, 3, 1, 4).unbind(0)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, C, D)
    return out.transpose(1, 2).reshape(B, C, n_head * D)


@pytest.mark.parametrize(("B", "C", "H", "D"), [
    (1, 1, 1, 16),     # one position
    (2, 5, 3, 16),     # C below one row block
    (3, 17, 2, 32),    # C past a 16-column chunk, not a multiple of 4
    (12, 64, 4, 32),   # the benchmark's 4×128 shape
    (1, 70, 1, 64),    # more than 64 key columns: two column groups
    (2, 33, 2, 128),   # D = 128: two 64-wide output groups
    (1, 256, 1, 16),   # the longest context the kernel takes
])
def test_causal_attention_and_its_backward_equal_sdpa(B: int, C: int, H: int, D: int) -> None:
    qkv = (torch.randn(B, C, 3 * H * D) * 2).requires_grad_()
    assert kernels.causal_attention_supported(qkv, H)
    want = _sdpa_from_qkv(qkv, H)
    grad = torch.randn_like(want)
    (want_grad,) = torch.autograd.grad(want, qkv, grad)
    out, lse = kernels.causal_attention(qkv.detach(), H)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # lse is each query's log Σ_j exp(score_j) over the keys it may see.
    q, k, _ = qkv.detach().view(B, C, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
    scores = (q @ k.transpose(-1, -2)) / D**0.5
    scores = scores.masked_fill(torch.ones(C, C, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    got_grad, none = kernels.causal_attention_backward(grad, qkv.detach(), out, lse, H)
    assert none is None
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)


def test_causal_attention_adds_the_bias_in_place_and_sums_its_gradient() -> None:
    B, C, H, D = 3, 21, 2, 16
    qkv, bias = torch.randn(B, C, 3 * H * D), torch.randn(3 * H * D, requires_grad=True)
    x = qkv.clone().requires_grad_()
    want = _sdpa_from_qkv(x + bias, H)
    grad = torch.randn_like(want)
    want_grad, want_bias_grad = torch.autograd.grad(want, [x, bias], grad)
    out, lse = kernels.causal_attention(qkv, H, bias.detach())
    torch.testing.assert_close(qkv, x.detach() + bias.detach())  # biased in place
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    got_grad, got_bias_grad = kernels.causal_attention_backward(grad, qkv, out, lse, H,
                                                                bias_grad=True)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_bias_grad, want_bias_grad, rtol=1e-4, atol=1e-4)


def test_causal_attention_declines_what_it_cannot_take() -> None:
    H = 2
    assert not kernels.causal_attention_supported(torch.randn(1, 4, 3 * H * 24), H)  # D=24
    too_long = kernels.ATTENTION_MAX_CONTEXT + 1
    assert not kernels.causal_attention_supported(torch.randn(1, too_long, 3 * H * 16), H)
    assert not kernels.causal_attention_supported(
        torch.randn(1, 4, 3 * H * 16, dtype=torch.float64), H)
    assert not kernels.causal_attention_supported(torch.randn(3 * H * 16, 4).t()[None], H)


@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_attention_module_native_path_equals_sdpa_path(monkeypatch, training: bool,
                                                       bias: bool) -> None:
    from tinylm.attention import MultiHeadAttention

    torch.manual_seed(0)
    attn = MultiHeadAttention(48, 3, 16, bias=bias).train(training)
    x = torch.randn(2, 21, 48, requires_grad=True)
    gy = torch.randn(2, 21, 48)
    calls = []
    real = kernels.causal_attention
    monkeypatch.setattr(kernels, "causal_attention",
                        lambda *a: calls.append(1) or real(*a))
    y = attn(x)
    assert calls, "the native kernel was not used"
    grads = torch.autograd.grad(y, [x, *attn.parameters()], gy)
    monkeypatch.setattr(kernels, "causal_attention_fits", lambda *a: False)
    want = attn(x)
    assert len(calls) == 1
    want_grads = torch.autograd.grad(want, [x, *attn.parameters()], gy)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_attention_under_cpu_autocast_takes_sdpa(monkeypatch) -> None:
    from tinylm.attention import MultiHeadAttention

    attn = MultiHeadAttention(32, 2, 16)
    monkeypatch.setattr(kernels, "causal_attention",
                        lambda *a: pytest.fail("the native kernel is float32 only"))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = attn(torch.randn(1, 8, 32))
    assert y.dtype == torch.bfloat16


def test_attention_dropout_in_training_takes_sdpa(monkeypatch) -> None:
    from tinylm.attention import MultiHeadAttention

    attn = MultiHeadAttention(32, 2, 16, dropout=0.1).train()
    calls = []
    real = kernels.causal_attention
    monkeypatch.setattr(kernels, "causal_attention", lambda *a: calls.append(1) or real(*a))
    attn(torch.randn(1, 8, 32))
    assert not calls, "the native kernel has no dropout"
    attn.eval()(torch.randn(1, 8, 32))  # eval: no dropout, the native kernel is fine
    assert calls


@pytest.mark.parametrize(("M", "E", "affine"), [(768, 128, True), (5, 37, True), (3, 300, False)])
def test_layer_norm_training_kernels_equal_torch(M: int, E: int, affine: bool) -> None:
    x = torch.randn(M, E) * 3 + 1
    w, b = (torch.randn(E), torch.randn(E)) if affine else (None, None)
    grad = torch.randn(M, E)
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    want = F.layer_norm(leaves[0], (E,), *(leaves[1:] or [None, None]), 1e-5)
    want_grads = torch.autograd.grad(want, leaves, grad)
    y, mean, rstd = kernels.layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, x.mean(-1))
    torch.testing.assert_close(rstd, 1 / torch.sqrt(x.var(-1, unbiased=False) + 1e-5))
    dx, dw, db = kernels.layer_norm_backward(grad, x, w, mean, rstd, affine, affine)
    got = [dx] + ([dw, db] if affine else [])
    assert (dw is None and db is None) or affine
    for g, ref in zip(got, want_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-4)


def _tiny_gpt(bias: bool = True, dropout: float = 0.0):
    from tinylm import GPT, ModelConfig

    torch.manual_seed(0)
    model = GPT(ModelConfig(vocab_size=50, context_length=40, n_layer=2, n_head=2,
                            n_embd=32, bias=bias, dropout=dropout))
    with torch.no_grad():
        for p in model.parameters():  # off the init values (ones/zeros) so all grads differ
            p += 0.05 * torch.randn_like(p)
    return model


def _loss_and_grads(model, ids):
    loss = model.loss(ids, ids)
    return loss, torch.autograd.grad(loss, list(model.parameters()))


@pytest.mark.parametrize("bias", [True, False])
def test_fused_training_block_equals_the_step_by_step_block(monkeypatch, bias: bool) -> None:
    from tinylm import model as model_module

    model = _tiny_gpt(bias)
    ids = torch.randint(0, 50, (3, 37))
    calls = []
    real = model_module._BlockFn.apply
    monkeypatch.setattr(model_module._BlockFn, "apply", lambda *a: calls.append(1) or real(*a))
    loss, grads = _loss_and_grads(model, ids)
    assert len(calls) == 2, "each block should have run fused"
    monkeypatch.setattr(model_module.Block, "_fusable", lambda self, x: False)
    want_loss, want_grads = _loss_and_grads(model, ids)
    assert len(calls) == 2
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=1e-6)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_fused_block_steps_aside_for_hooks_dropout_and_inference(monkeypatch) -> None:
    from tinylm import model as model_module

    calls = []
    real = model_module._BlockFn.apply
    monkeypatch.setattr(model_module._BlockFn, "apply", lambda *a: calls.append(1) or real(*a))
    model = _tiny_gpt()
    ids = torch.randint(0, 50, (2, 9))
    seen = []
    hook = model.blocks[1].ffn.up.register_forward_hook(lambda *a: seen.append(1))
    model.loss(ids, ids).backward()
    assert seen == [1] and len(calls) == 1  # block 1 unfused so its hook fires; block 0 fused
    hook.remove()
    hook = model.blocks[0].attn.out.register_forward_pre_hook(lambda *a: seen.append(2))
    calls.clear()
    model.loss(ids, ids).backward()
    assert seen == [1, 2] and len(calls) == 1  # now block 0 steps aside
    hook.remove()
    calls.clear()
    with torch.no_grad():
        model(ids)
    assert not calls  # inference keeps the modules (the explain tool hooks them)
    _tiny_gpt(dropout=0.1).train().loss(ids, ids).backward()
    assert not calls  # the native block has no dropout
