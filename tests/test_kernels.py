"""The native CPU kernels (tinylm.native.ops) against torch's own ops as oracles, and
the checks that keep every call inside the memory its tensors own."""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tinylm.core.attention import RMSNorm, apply_rope, repeat_kv, rope_angles

pytest.importorskip("tinylm.native", reason="the optional native package is absent")

from tinylm import native  # noqa: E402
from tinylm.native import build, ops  # noqa: E402
from tinylm.native.decoding import packed_weight  # noqa: E402
from tinylm.native.functions import FeedForwardFn  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TINYLM_NATIVE") == "0",
                                reason="native kernels turned off by TINYLM_NATIVE=0")


@pytest.fixture(scope="module")
def lib() -> ops.Library:
    library = native.load()
    assert library is not None  # this machine has a C compiler: the fast path must be live
    return library


def test_the_kernel_builds_and_loads_here(lib) -> None:
    assert native.available()
    assert (build.SOURCES / "tinylm.h").exists() and list(build.SOURCES.glob("*.c"))


def test_signatures_come_from_the_header_and_cover_every_export(lib) -> None:
    sigs = ops.parse_header(ops.HEADER.read_text())
    assert len(sigs) == 41  # + gemm.c's 2 (the work size, the product)
    # + train_block.c's 3 (the work size, a block's forward, its backward)
    # + blocks.c's 4 (block sizes, packing, the product)
    # + the ragged batch's 3: tl_embed_rows, tl_attend_rows, tl_rope_rows
    # + bpe.c's 4: tl_bpe_new (returns a pointer), _free, _encode, _split
    # + decode.c's tl_decode_layers (a decoding step's blocks from a plan)
    # + variants.c's tl_rope_heads (a decoding step's QK-norm + rotation, in place)
    assert ops.header_constant("PLAN_LAYER") == 4 + 4 * ops.header_constant("PLAN_LINEAR")
    with pytest.raises(KeyError, match="no integer"):
        ops.header_constant("NO_SUCH_CONSTANT")
    assert sigs["tl_bpe_new"][0] is ctypes.c_void_p
    assert sigs["tl_linear"][1][:2] == [ctypes.c_void_p, ctypes.c_long]
    assert sigs["tl_attn_fwd"][0] is ctypes.c_int  # allocates: reports out of memory
    out = subprocess.run(["nm", "-D", "--defined-only", lib.raw._name], capture_output=True,
                         text=True)
    if out.returncode == 0:
        exported = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
        assert {n for n in exported if n.startswith("tl_")} == set(sigs)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize(("out_features", "in_features"), [(1, 1), (33, 17), (96, 64),
                                                           (130, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_equals_f_linear(lib, rows: int, out_features: int, in_features: int,
                                       bias: bool) -> None:
    lin = torch.nn.Linear(in_features, out_features, bias=bias)
    x = torch.randn(rows, in_features)  # (B, I), as in a decoding step
    with torch.inference_mode():
        got = lib.linear(x, lib.pack(lin.weight), lin.bias, out_features)
        torch.testing.assert_close(got, lin(x), rtol=1e-5, atol=1e-5)


def test_fused_epilogues_gelu_and_residual(lib) -> None:
    W, b = torch.randn(40, 24), torch.randn(40)
    x, res = torch.randn(3, 24), torch.randn(3, 40)
    packed = lib.pack(W)
    y = torch.empty(3, 40)
    lib.raw.tl_linear(x.data_ptr(), 24, packed.data_ptr(), b.data_ptr(), y.data_ptr(), 3, 24,
                      40, 2, 1, None)
    torch.testing.assert_close(y, F.gelu(F.linear(x, W, b), approximate="tanh"),
                               rtol=1e-5, atol=1e-5)
    want = res + F.linear(x, W, b)
    lib.raw.tl_linear(x.data_ptr(), 24, packed.data_ptr(), b.data_ptr(), res.data_ptr(), 3, 24,
                      40, 2, 0, res.data_ptr())  # in place: res = res + x·Wᵀ + b
    torch.testing.assert_close(res, want, rtol=1e-5, atol=1e-5)


def test_packed_copy_follows_in_place_weight_changes(lib) -> None:
    W = torch.randn(20, 10)
    first = packed_weight(lib, W)
    assert packed_weight(lib, W) is first  # cached while unchanged
    with torch.no_grad():
        W.mul_(2)  # e.g. an optimizer step
    x = torch.randn(1, 10)
    torch.testing.assert_close(lib.linear(x, packed_weight(lib, W), None, 20), F.linear(x, W))


@pytest.mark.parametrize("V", [1, 5, 16, 17, 50257])
@pytest.mark.parametrize("B", [1, 3])
def test_argmax_equals_torch_with_ties_and_nan(lib, V: int, B: int) -> None:
    logits = torch.randn(B, V)
    assert torch.equal(lib.argmax(logits), logits.argmax(-1))
    tied = logits.clone()
    tied[:, -1] = tied[:, 0] = tied.max() + 1  # first and last share the maximum
    assert torch.equal(lib.argmax(tied), torch.zeros(B, dtype=torch.long))
    if V > 2:
        logits[0, V // 2] = float("nan")  # torch.argmax treats NaN as the largest
        assert torch.equal(lib.argmax(logits), logits.argmax(-1))
    strided = torch.randn(B, 2 * V)[:, :V]  # rows of a wider tensor
    assert torch.equal(lib.argmax(strided), strided.argmax(-1))


@pytest.mark.parametrize(("B", "H", "D", "pos"), [(1, 1, 16, 0), (2, 3, 64, 9), (3, 2, 20, 30),
                                                 (2, 2, 70, 17), (1, 2, 136, 31)])
def test_attend_one_equals_sdpa_over_the_cache(lib, B: int, H: int, D: int, pos: int) -> None:
    """Keys 4 at a time and the rest, exponentials a vector at a time and the rest, the
    output AV·VL features at a time in registers (D past one such chunk, D not a
    multiple of the vector width)."""
    qkv = torch.randn(B, 1, 3, H, D).permute(2, 0, 3, 1, 4)  # views, as MultiHeadAttention
    q, k, v = qkv.unbind(0)  # 3 × (B, H, 1, D), not contiguous
    k_cache, v_cache = torch.randn(B, H, 32, D), torch.randn(B, H, 32, D)
    out = lib.attend_one(q, k, v, k_cache, v_cache, pos, torch.empty(B * H * 32))
    assert torch.equal(k_cache[:, :, pos:pos + 1], k) and torch.equal(v_cache[:, :, pos:pos + 1], v)
    want = F.scaled_dot_product_attention(q, k_cache[:, :, :pos + 1], v_cache[:, :, :pos + 1])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("H", "Hkv", "D"), [(2, 2, 16), (6, 2, 20), (9, 3, 64)])
def test_attend_rows_equals_each_row_alone(lib, H: int, Hkv: int, D: int) -> None:
    """A ragged batch (continuous batching): row b's new key and value written at its own
    position pos[b], its query heads attending over its positions 0..pos[b] only, each
    group of H / H_kv query heads over its one key/value head -- equal to SDPA on that
    row alone (enable_gqa); nothing past a row's position is written."""
    pos = torch.tensor([0, 9, 3, 30])
    B, L = len(pos), 32
    qkv = torch.randn(B, (H + 2 * Hkv) * D)
    kc, vc = torch.randn(B, Hkv, L, D), torch.randn(B, Hkv, L, D)
    k0, v0 = kc.clone(), vc.clone()  # nothing past a row's position is written
    out, scratch = torch.empty(B, H * D), torch.empty(B * H * L)
    lib.raw.tl_attend_rows(qkv.data_ptr(), qkv.stride(0), kc.data_ptr(), vc.data_ptr(),
                           kc.stride(0), kc.stride(1), B, H, Hkv, D, pos.data_ptr(),
                           1.0 / math.sqrt(D), out.data_ptr(), scratch.data_ptr(),
                           L, 1)
    for b, p in enumerate(pos.tolist()):
        q = qkv[b, :H * D].view(H, 1, D)
        k, v = qkv[b, H * D:(H + Hkv) * D].view(Hkv, D), qkv[b, (H + Hkv) * D:].view(Hkv, D)
        assert torch.equal(kc[b, :, p], k) and torch.equal(vc[b, :, p], v)
        for c, c0 in ((kc, k0), (vc, v0)):
            assert torch.equal(c[b, :, :p], c0[b, :, :p])
            assert torch.equal(c[b, :, p + 1:], c0[b, :, p + 1:])
        want = F.scaled_dot_product_attention(q, kc[b, :, :p + 1], vc[b, :, :p + 1],
                                              enable_gqa=H != Hkv)
        torch.testing.assert_close(out[b].view(H, 1, D), want, rtol=1e-5, atol=1e-5)


def test_embed_and_rope_rows_take_each_rows_own_position(lib) -> None:
    """tl_embed_rows and tl_rope_rows: row b at positions[b], equal to the one-position
    kernels (tl_embed, tl_rope_heads) run on that row alone."""
    from tinylm.core.attention import rope_angles
    from tinylm.native.variants import signed_sin

    tok, pos_table, ids = torch.randn(10, 8), torch.randn(6, 8), torch.tensor([3, 9, 0])
    at = torch.tensor([5, 0, 2])
    x = torch.empty(3, 8)
    assert lib.raw.tl_embed_rows(ids.data_ptr(), tok.data_ptr(), pos_table.data_ptr(),
                                 at.data_ptr(), x.data_ptr(), 3, 8, 10) == 0
    torch.testing.assert_close(x, tok[ids] + pos_table[at], rtol=0, atol=0)
    D, n = 16, 3
    cos, sin = rope_angles(0, 12, D, 10000.0)
    sin_pm = signed_sin(sin).contiguous()
    w, heads = torch.randn(D), torch.randn(3, n * D + 5)
    got, tmp = heads.clone(), torch.empty(D)
    lib.raw.tl_rope_rows(got.data_ptr(), got.stride(0), 3, n, D, w.data_ptr(), cos.data_ptr(),
                         sin_pm.data_ptr(), at.data_ptr(), 1e-6, 1, tmp.data_ptr())
    for b, p in enumerate(at.tolist()):
        want = lib.rope_heads(heads[b:b + 1].clone(), n, w, cos[p], sin_pm[p], 1e-6, tmp)
        torch.testing.assert_close(got[b:b + 1], want, rtol=0, atol=0)


@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_equals_f_layer_norm(lib, affine: bool) -> None:
    x = torch.randn(4, 48) * 3 + 1
    w, b = (torch.randn(48), torch.randn(48)) if affine else (None, None)
    y, _, _ = lib.layer_norm(x, w, b, 1e-5)  # also the decoding step's LayerNorm
    torch.testing.assert_close(y, F.layer_norm(x, (48,), w, b, 1e-5), rtol=1e-5, atol=1e-5)


def test_embed_rejects_out_of_range_ids(lib) -> None:
    tok, pos = torch.randn(10, 4), torch.randn(6, 4)
    x = torch.zeros(2, 4)
    ids = torch.tensor([3, 9])
    assert lib.raw.tl_embed(ids.data_ptr(), tok.data_ptr(), pos.data_ptr(), 2, x.data_ptr(),
                        2, 4, 10) == 0
    torch.testing.assert_close(x, tok[ids] + pos[2])
    bad = torch.tensor([3, 10])
    assert lib.raw.tl_embed(bad.data_ptr(), tok.data_ptr(), pos.data_ptr(), 2, x.data_ptr(),
                        2, 4, 10) == 1


def test_gelu_and_its_fused_backward_equal_torch(lib) -> None:
    x = torch.randn(3, 37, 20) * 4  # 2220 floats: vector body and scalar tail
    x.view(-1)[:6] = torch.tensor([0.0, 1e-8, -60.0, 60.0, 100.0, -100.0])
    torch.testing.assert_close(lib.bias_gelu_(x.clone(), None),
                               F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(x)
    want = torch.ops.aten.gelu_backward(grad, x, approximate="tanh")
    grad_x, y, none = lib.gelu_backward(grad.clone(), x, False)
    assert none is None
    torch.testing.assert_close(grad_x, want, rtol=1e-5, atol=1e-5)
    _, _, colsum = lib.gelu_backward(grad.clone(), x, True)  # a bias's gradient
    torch.testing.assert_close(colsum, want.reshape(-1, 20).sum(0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(y, F.gelu(x, approximate="tanh"), rtol=1e-5, atol=1e-6)


def test_bias_gelu_adds_in_place_and_returns_gelu(lib) -> None:
    a, b = torch.randn(7, 37), torch.randn(37)
    want_h = a + b
    g = lib.bias_gelu_(a, b)
    torch.testing.assert_close(a, want_h)
    torch.testing.assert_close(g, F.gelu(want_h, approximate="tanh"), rtol=1e-5, atol=1e-6)


def test_the_elementwise_and_attention_kernels_write_into_given_buffers(lib) -> None:
    """The ``out`` buffers (the whole-block step's reused scratch) receive the same
    values as fresh outputs, and a buffer of another shape is refused."""
    a, b = torch.randn(5, 37), torch.randn(37)
    out = torch.full((5, 37), float("nan"))
    assert lib.bias_gelu_(a.clone(), b, out) is out
    torch.testing.assert_close(out, F.gelu(a + b, approximate="tanh"), rtol=1e-5, atol=1e-6)
    grad, y = torch.randn(5, 37), torch.full((5, 37), float("nan"))
    grad_x, got_y, _ = lib.gelu_backward(grad.clone(), a, True, y)
    assert got_y is y
    torch.testing.assert_close(y, F.gelu(a, approximate="tanh"), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad_x, lib.gelu_backward(grad.clone(), a, True)[0])
    qkv, H = torch.randn(2, 19, 3 * 2 * 16), 2
    o, lse = lib.causal_attention(qkv, H)
    grad_o, into = torch.randn_like(o), torch.full_like(qkv, float("nan"))
    got, _ = lib.causal_attention_backward(grad_o, qkv, o, lse, H, grad_qkv=into)
    assert got is into
    torch.testing.assert_close(into, lib.causal_attention_backward(grad_o, qkv, o, lse, H)[0])
    for call in (lambda: lib.bias_gelu_(a, None, torch.empty(37, 5)),
                 lambda: lib.gelu_backward(grad, a, False, torch.empty(5, 36)),
                 lambda: lib.causal_attention_backward(grad_o, qkv, o, lse, H,
                                                       grad_qkv=torch.empty(2, 19, 95))):
        with pytest.raises(ops.OpError, match="shape"):
            call()


def test_the_forward_kernels_write_into_given_buffers(lib) -> None:
    """The ``out`` buffers of the forward kernels (the inference block's reused scratch,
    tinylm.native.variants.block_inference) get the values of a fresh output (the
    statistics too); a buffer of another shape is refused."""
    from tinylm.native.variants import rope_tables

    x, w, b = torch.randn(6, 32), torch.randn(32), torch.randn(32)
    qkv, H = torch.randn(2, 5, 3 * 2 * 16), 2
    cos, sin = rope_tables(5, 16, 10000.0, torch.device("cpu"))
    gains = torch.rand(16) + 0.5, torch.rand(16) + 0.5
    calls = {  # name: (call with out, out's shape)
        "layer_norm": (lambda out: lib.layer_norm(x, w, b, 1e-5, out), (6, 32)),
        "rms_norm": (lambda out: lib.rms_norm(x, w, 1e-5, out), (6, 32)),
        "qk_rope": (lambda out: lib.qk_rope(qkv, H, H, *gains, cos, sin, 1e-6, out),
                    (2, 5, 96)),
        "causal_attention": (lambda out: lib.causal_attention(qkv, H, None, out), (2, 5, 32)),
        "relu2": (lambda out: (lib.relu2(x, out),), (6, 32)),
    }
    for name, (call, shape) in calls.items():
        fresh = call(None)
        into = torch.full(shape, float("nan"))
        got = call(into)
        assert got[0] is into, name
        for g, f in zip(got, fresh, strict=True):
            torch.testing.assert_close(g, f, rtol=0, atol=0, msg=name)
        with pytest.raises(ops.OpError, match="shape"):
            call(torch.empty(shape[:-1] + (shape[-1] + 1,)))


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
    (2, 131, 3, 48),   # operands past L1_PART: packed panels, a last panel narrower than G
    (1, 256, 2, 64),   # the benchmark's 6×384 shape (panels and column groups)
])
def test_causal_attention_and_its_backward_equal_sdpa(lib, B: int, C: int, H: int,
                                                       D: int) -> None:
    qkv = (torch.randn(B, C, 3 * H * D) * 2).requires_grad_()
    want = _sdpa_from_qkv(qkv, H)
    grad = torch.randn_like(want)
    (want_grad,) = torch.autograd.grad(want, qkv, grad)
    out, lse = lib.causal_attention(qkv.detach(), H)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    # lse is each query's log Σ_j exp(score_j) over the keys it may see.
    q, k, _ = qkv.detach().view(B, C, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
    scores = (q @ k.transpose(-1, -2)) / D**0.5
    scores = scores.masked_fill(torch.ones(C, C, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse, scores.logsumexp(-1), rtol=1e-5, atol=1e-5)
    got_grad, none = lib.causal_attention_backward(grad, qkv.detach(), out, lse, H)
    assert none is None
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)


def test_causal_attention_adds_the_bias_in_place_and_sums_its_gradient(lib) -> None:
    B, C, H, D = 3, 21, 2, 16
    qkv, bias = torch.randn(B, C, 3 * H * D), torch.randn(3 * H * D, requires_grad=True)
    x = qkv.clone().requires_grad_()
    want = _sdpa_from_qkv(x + bias, H)
    grad = torch.randn_like(want)
    want_grad, want_bias_grad = torch.autograd.grad(want, [x, bias], grad)
    out, lse = lib.causal_attention(qkv, H, bias.detach())
    torch.testing.assert_close(qkv, x.detach() + bias.detach())  # biased in place
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    got_grad, got_bias_grad = lib.causal_attention_backward(grad, qkv, out, lse, H,
                                                                bias_grad=True)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_bias_grad, want_bias_grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(("M", "E", "affine"), [(768, 128, True), (5, 37, True), (3, 300, False)])
def test_layer_norm_training_kernels_equal_torch(lib, M: int, E: int, affine: bool) -> None:
    x = torch.randn(M, E) * 3 + 1
    w, b = (torch.randn(E), torch.randn(E)) if affine else (None, None)
    grad = torch.randn(M, E)
    leaves = [t.clone().requires_grad_() for t in (x, w, b) if t is not None]
    want = F.layer_norm(leaves[0], (E,), *(leaves[1:] or [None, None]), 1e-5)
    want_grads = torch.autograd.grad(want, leaves, grad)
    y, mean, rstd = lib.layer_norm(x, w, b, 1e-5)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean, x.mean(-1))
    torch.testing.assert_close(rstd, 1 / torch.sqrt(x.var(-1, unbiased=False) + 1e-5))
    residual_bias = torch.randn(E)  # the same pass also starts a residual sum: x + bias
    for rb, start in ((residual_bias, x + residual_bias), (None, x)):
        y_r, mean_r, rstd_r, res = lib.layer_norm_residual(x, w, b, 1e-5, rb)
        assert torch.equal(y_r, y) and torch.equal(mean_r, mean) and torch.equal(rstd_r, rstd)
        assert torch.equal(res, start) and res.data_ptr() != x.data_ptr()
    dx, dw, db = lib.layer_norm_backward(grad, x, w, mean, rstd, affine, affine)
    got = [dx] + ([dw, db] if affine else [])
    assert (dw is None and db is None) or affine
    for g, ref in zip(got, want_grads, strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-4)
    residual = torch.randn(M, E)  # a residual path's gradient, added in the same pass
    dx_res, _, _ = lib.layer_norm_backward(grad, x, w, mean, rstd, False, False, residual)
    torch.testing.assert_close(dx_res, want_grads[0] + residual, rtol=1e-4, atol=1e-4)
    residual_sum = torch.full((E,), float("nan"))  # every entry written
    dx_sum, dw_sum, db_sum = lib.layer_norm_backward(grad, x, w, mean, rstd, affine, affine,
                                                     residual, residual_sum)
    torch.testing.assert_close(residual_sum, residual.sum(0), rtol=1e-4, atol=1e-4)
    for g, ref in zip([dx_sum] + ([dw_sum, db_sum] if affine else []),
                      [dx_res] + list(want_grads[1:]), strict=True):
        torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ops.OpError, match="needs a residual"):
        lib.layer_norm_backward(grad, x, w, mean, rstd, False, False, None, residual_sum)
    with pytest.raises(ops.OpError, match="shape"):
        lib.layer_norm_backward(grad, x, w, mean, rstd, False, False, residual[1:])


@pytest.mark.parametrize(("M", "E", "affine"), [(768, 128, True), (5, 37, True), (3, 300, False)])
def test_rms_norm_training_kernels_equal_the_reference_module(lib, M: int, E: int,
                                                              affine: bool) -> None:
    norm = RMSNorm(E, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x, grad = torch.randn(M, E) * 3 + 1, torch.randn(M, E)
    xr = x.clone().requires_grad_()
    want = norm(xr) if affine else xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6)
    leaves = [xr, norm.weight] if affine else [xr]
    want_grads = torch.autograd.grad(want, leaves, grad)
    w = norm.weight.detach() if affine else None
    y, rs = lib.rms_norm(x, w, 1e-6)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(rs, torch.rsqrt(x.pow(2).mean(-1) + 1e-6))
    residual = torch.randn(M, E)  # a residual path's gradient, added in the same pass
    dx, dw = lib.rms_norm_backward(grad, x, w, rs, True, residual)
    torch.testing.assert_close(dx, want_grads[0] + residual, rtol=1e-4, atol=1e-4)
    if affine:
        torch.testing.assert_close(dw, want_grads[1], rtol=1e-4, atol=1e-4)
    else:
        assert dw is None
    with pytest.raises(ops.OpError, match="shape"):
        lib.rms_norm_backward(grad, x, w, rs[1:], False)


@pytest.mark.parametrize(("n", "D", "norm", "rope"), [
    (6, 64, True, True), (2, 18, False, True), (3, 6, True, False), (4, 32, True, True),
    (1, 16, False, False)])
def test_decoding_rope_heads_in_place_equal_the_reference(lib, n: int, D: int, norm: bool,
                                                          rope: bool) -> None:
    """A decoding step's QK-norm + rotation of n heads at one position, in place in a
    wider row (the rest untouched), against attention.py's RMSNorm and apply_rope."""
    from tinylm.native.variants import signed_sin

    B, pos, W = 3, 37, n * D + 7
    x = torch.randn(B, W)
    heads = x[:, :n * D].reshape(B, n, D)
    rms = RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        rms.weight.normal_()
        want = rms(heads) if norm else heads
    cos, sin = rope_angles(0, 64, D, 10000.0)
    if rope:
        want = apply_rope(want, cos[pos], sin[pos])
    got = lib.rope_heads(x.clone(), n, rms.weight.detach() if norm else None,
                         cos[pos] if rope else None,
                         signed_sin(sin)[pos].contiguous() if rope else None, 1e-6,
                         torch.empty(D))
    torch.testing.assert_close(got[:, :n * D].reshape(B, n, D), want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, n * D:], x[:, n * D:])
    with pytest.raises(ops.OpError, match="heads"):
        lib.rope_heads(x, n + 2, None, cos[pos], signed_sin(sin)[pos].contiguous(), 1e-6,
                       torch.empty(D))
    with pytest.raises(ops.OpError, match="together"):
        lib.rope_heads(x, n, None, cos[pos], None, 1e-6, torch.empty(D))
    with pytest.raises(ops.OpError, match="tmp"):
        lib.rope_heads(x, n, None, cos[pos], signed_sin(sin)[pos].contiguous(), 1e-6,
                       torch.empty(D - 1))


@pytest.mark.parametrize(("H", "Hkv", "D", "norm", "rope"), [
    (4, 4, 32, True, True), (6, 2, 16, True, True), (3, 1, 18, False, True),
    (4, 2, 16, True, False), (2, 1, 16, False, False), (2, 2, 6, True, True)])
def test_qk_norm_rope_kernels_equal_the_reference_math(lib, H: int, Hkv: int, D: int,
                                                       norm: bool, rope: bool) -> None:
    """One pass from qkv to the attention kernel's input, against attention.py's own
    RMSNorm, apply_rope and repeat_kv; and its backward against autograd's."""
    from tinylm.native.variants import rope_tables

    B, C = 2, 7
    qkv = torch.randn(B, C, (H + 2 * Hkv) * D) * 2
    qn, kn = RMSNorm(D, eps=1e-6), RMSNorm(D, eps=1e-6)
    with torch.no_grad():
        qn.weight.normal_(), kn.weight.normal_()
    cos, sin = rope_angles(0, C, D, 10000.0)
    leaf = qkv.clone().requires_grad_()
    q, k, v = leaf.view(B, C, H + 2 * Hkv, D).transpose(1, 2).split([H, Hkv, Hkv], dim=1)
    if norm:
        q, k = qn(q), kn(k)
    if rope:
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = repeat_kv(k, H // Hkv), repeat_kv(v, H // Hkv)
    want = torch.cat([t.transpose(1, 2).reshape(B, C, H * D) for t in (q, k, v)], dim=-1)
    grad = torch.randn_like(want)
    params = [qn.weight, kn.weight] if norm else []
    want_grads = torch.autograd.grad(want, [leaf, *params], grad)
    tables = rope_tables(C, D, 10000.0, torch.device("cpu")) if rope else (None, None)
    gains = (qn.weight.detach(), kn.weight.detach()) if norm else (None, None)
    got, rs = lib.qk_rope(qkv, H, Hkv, *gains, *tables, 1e-6)
    torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-5)
    got_grad, dw = lib.qk_rope_backward(grad, qkv, H, Hkv, *gains, rs, *tables, True)
    torch.testing.assert_close(got_grad, want_grads[0], rtol=1e-4, atol=1e-4)
    if norm:
        torch.testing.assert_close(dw[0], want_grads[1], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(dw[1], want_grads[2], rtol=1e-4, atol=1e-4)
    else:
        assert dw is None
    with pytest.raises(ops.OpError, match="key/value heads"):
        lib.qk_rope(qkv, H + 1, Hkv, *gains, *tables, 1e-6)


def test_relu_squared_kernels_equal_torch(lib) -> None:
    h = torch.randn(37, 101) * 3  # 3737 elements: vector body and scalar tail
    h[0, :5] = 0.0
    grad = torch.randn_like(h)
    hr = h.clone().requires_grad_()
    want = F.relu(hr).square()
    (want_grad,) = torch.autograd.grad(want, hr, grad)
    torch.testing.assert_close(lib.relu2(h), want.detach())
    got_grad, g = lib.relu2_backward(grad.clone(), h)
    torch.testing.assert_close(got_grad, want_grad)
    torch.testing.assert_close(g, want.detach())


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("native_gelu", [True, False])
def test_ffn_function_gradients_equal_plain_autograd(lib, bias: bool, native_gelu: bool) -> None:
    x = torch.randn(2, 5, 12, requires_grad=True)
    w_up, w_down = torch.randn(48, 12, requires_grad=True), torch.randn(12, 48, requires_grad=True)
    b_up = torch.randn(48, requires_grad=True) if bias else None
    b_down = torch.randn(12, requires_grad=True) if bias else None
    inputs = [t for t in (x, w_up, b_up, w_down, b_down) if t is not None]
    gy = torch.randn(2, 5, 12)
    y = FeedForwardFn.apply(x, w_up, b_up, w_down, b_down, lib if native_gelu else None)
    ref = F.linear(F.gelu(F.linear(x, w_up, b_up), approximate="tanh"), w_down, b_down)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    grads = torch.autograd.grad(y, inputs, gy)
    want = torch.autograd.grad(ref, inputs, gy)
    for got, w in zip(grads, want, strict=True):
        torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-4)


def test_ffn_function_is_exact_in_float64_without_the_library() -> None:
    # torch's GELU in float64 (how it runs on CUDA or without the library): equal to
    # plain autograd up to rounding, and gradcheck-correct.
    x = torch.randn(3, 4, 8, dtype=torch.float64, requires_grad=True)
    w_up = torch.randn(32, 8, dtype=torch.float64, requires_grad=True)
    w_down = torch.randn(8, 32, dtype=torch.float64, requires_grad=True)
    b = torch.randn(32, dtype=torch.float64, requires_grad=True)
    y = FeedForwardFn.apply(x, w_up, b, w_down, None, None)
    ref = F.linear(F.gelu(F.linear(x, w_up, b), approximate="tanh"), w_down)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    w_up, w_down, b = w_up.detach()[:6], w_down.detach()[:, :6], b.detach()[:6]
    b.requires_grad_()
    torch.autograd.gradcheck(lambda h, bias: FeedForwardFn.apply(h, w_up, bias, w_down, None,
                                                                 None),
                             (x[:1, :2].detach().requires_grad_(), b))


@pytest.mark.parametrize("bad", ["float64", "strided", "shape", "device", "too-long"])
def test_wrappers_refuse_tensors_they_cannot_take(lib, bad: str) -> None:
    B, C, H, D = 2, 8, 2, 16
    qkv = torch.randn(B, C, 3 * H * D)
    if bad == "float64":
        qkv = qkv.double()
    elif bad == "strided":
        qkv = torch.randn(B, 3 * H * D, C).transpose(1, 2)
    elif bad == "shape":
        qkv = torch.randn(B, C, 3 * H * D + 1)
    elif bad == "device":
        qkv = torch.empty(B, C, 3 * H * D, device="meta")
    else:
        qkv = torch.randn(1, ops.ATTENTION_MAX_CONTEXT + 1, 3 * H * D)
    with pytest.raises(ops.OpError):
        lib.causal_attention(qkv, H)
    x = torch.randn(4, 24)
    with pytest.raises(ops.OpError, match="float32"):
        lib.layer_norm(x.double(), None, None, 1e-5)
    with pytest.raises(ops.OpError, match="contiguous"):
        lib.bias_gelu_(torch.randn(24, 4).t(), None)
    with pytest.raises(ops.OpError, match="shape"):
        lib.layer_norm(x, torch.randn(23), None, 1e-5)  # a weight of the wrong size
    with pytest.raises(ops.OpError, match="shape"):
        lib.linear(x, lib.pack(torch.randn(5, 23)), None, 5)  # packed for another width
    with pytest.raises(ops.OpError):
        lib.attend_one(*(torch.randn(1, 1, 1, 16),) * 3, torch.randn(1, 1, 4, 16),
                       torch.randn(1, 1, 4, 16), 4, torch.empty(64))  # past the cache
    with pytest.raises(ops.OpError, match="int64"):
        lib.embed(torch.tensor([1, 2], dtype=torch.int32), torch.randn(5, 4),
                  torch.randn(3, 4), 0)


def test_without_a_compiler_everything_falls_back(tmp_path) -> None:
    # A fresh process with no compiler and an empty cache: no library, the reference
    # plans everywhere, and training and generation still work through torch's kernels.
    code = (
        "import torch\n"
        "from tinylm import GPT, ModelConfig, generate, native\n"
        "m = GPT(ModelConfig(vocab_size=11, context_length=8, n_layer=1, n_head=1, "
        "n_embd=16))\n"
        "assert not native.available()\n"
        "plan = native.accelerate(m, 'cpu')\n"
        "assert plan.paths == {'ffn'}, plan.paths  # the FFN's recompute needs no library\n"
        "m.loss(torch.tensor([[1, 2, 3]]), torch.tensor([[2, 3, 4]])).backward()\n"
        "with torch.inference_mode(), plan.decoder(1) as d: assert d.path == 'torch'\n"
        "print(generate(m, [1, 2], 3, temperature=0).shape)\n"
    )
    env = dict(os.environ, CC=str(tmp_path / "no-such-cc"), XDG_CACHE_HOME=str(tmp_path),
               TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch.Size([1, 5])"


# The kernels are written for the target's vector width (tinylm.h: VL = 16 floats with
# AVX-512, 8 with AVX/AVX2, 4 otherwise). -march=native builds one width; these build the
# others this CPU can run (4 floats: plain SSE2 and SSE4.1; 8: AVX2 where -march=native
# is AVX-512) and hold them to the same self-check and to SDPA / F.linear at the training
# and decoding shapes' edge cases -- each width's register blocking (KEEP_IN_REGISTER).
def _cpu_flags() -> set[str]:
    if not os.path.exists("/proc/cpuinfo"):
        return set()
    with open("/proc/cpuinfo") as f:
        return {w for line in f if line.startswith("flags") for w in line.split()}


NARROW_TARGETS = (["x86-64", "x86-64-v2"]
                  + (["x86-64-v3"] if {"avx2", "avx512f"} <= _cpu_flags() else [])
                  if os.uname().machine == "x86_64" else [])


@pytest.mark.parametrize("march", NARROW_TARGETS)
def test_every_vector_width_this_cpu_runs_computes_the_same(tmp_path, monkeypatch,
                                                           march) -> None:
    from tinylm.native import selfcheck

    monkeypatch.setattr(build, "FLAGS", [f"-march={march}" if f == "-march=native" else f
                                         for f in build.FLAGS])
    narrow = ops.Library(build.load_library(
        build.SOURCES, tmp_path / "kernels", lambda cdll: selfcheck.run(ops.Library(cdll)),
        name="narrow"))
    g = torch.Generator().manual_seed(3)
    # row tiles across 16-boundaries; then operands past L1_PART (packed, grouped)
    for B, C, H, D in ((2, 37, 3, 48), (1, 70, 2, 32), (1, 131, 2, 48)):
        qkv = torch.randn(B, C, 3 * H * D, generator=g, requires_grad=True)
        q, k, v = qkv.view(B, C, 3, H, D).permute(2, 0, 3, 1, 4).unbind(0)
        want = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        grad = torch.randn(B, C, H * D, generator=g)
        (want_grad,) = torch.autograd.grad(want.reshape(B, C, H * D), qkv, grad)
        out, lse = narrow.causal_attention(qkv.detach().clone(), H)
        got_grad, _ = narrow.causal_attention_backward(grad, qkv.detach(), out, lse, H)
        torch.testing.assert_close(out, want.reshape(B, C, H * D), rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_grad, want_grad, rtol=1e-4, atol=1e-4)
    for M in (1, 3, 7, 8, 16):  # every row blocking of the packed linear
        W, b, x = torch.randn(45, 129, generator=g), torch.randn(45), torch.randn(M, 129)
        torch.testing.assert_close(narrow.linear(x, narrow.pack(W), b, 45),
                                   F.linear(x, W, b), rtol=1e-4, atol=1e-4)
    for G in (300, 7):  # the int8 kernel: every row block, two input blocks of 256
        q = torch.randint(-127, 128, (45, 300), generator=g, dtype=torch.int8)
        s = torch.rand(45, -(-300 // G), generator=g) / 100
        W = q.float() * s.repeat_interleave(G, dim=1)[:, :300]
        for M in (1, 2, 3, 4, 5, 8, 16):  # tiles of 4 rows, walks of 8
            x = torch.randn(M, 300, generator=g)
            torch.testing.assert_close(narrow.linear_q8(x, q, s, G, b), F.linear(x, W, b),
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(narrow.linear_q8(x, q, s, G, b, 1),  # vector GELU
                                       F.gelu(F.linear(x, W, b), approximate="tanh"),
                                       rtol=1e-4, atol=1e-4)
    for B, H, D, pos in ((2, 3, 20, 9), (1, 2, 70, 30)):  # one-token attention over a cache
        q, k, v = (torch.randn(B, H, 1, D, generator=g) for _ in range(3))
        k_cache, v_cache = torch.randn(B, H, 32, D, generator=g), torch.randn(B, H, 32, D)
        out = narrow.attend_one(q, k, v, k_cache, v_cache, pos, torch.empty(B * H * 32))
        want = F.scaled_dot_product_attention(q, k_cache[:, :, :pos + 1],
                                              v_cache[:, :, :pos + 1])
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="an x86 target")
def test_the_avx512_build_compiles_cleanly(tmp_path) -> None:
    """Compile only (this CPU may not run it): the 16-float build has no warnings."""
    compiler = build.find_compiler()
    for src in sorted(build.SOURCES.glob("*.c")):
        done = subprocess.run([compiler, "-O3", "-march=skylake-avx512", "-fopenmp",
                               "-std=gnu11", "-Wall", "-Wextra", "-Werror", "-c", str(src),
                               "-o", str(tmp_path / (src.stem + ".o"))],
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
